"""Engine outputs -> OpenAI's JSON: logprobs in the completions and chat shapes, vLLM's prompt_logprobs, usage."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nanoserve.sampling import TokenLogprobs

# JSON has no -inf; vLLM clamps to this so every client can parse the body
_FLOOR = -9999.0

TokenText = Callable[[int], str]


def token_namer(tokenizer, as_ids: bool) -> TokenText:
    """How logprobs name a token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
    return (lambda t: f"token_id:{t}") if as_ids else tokenizer.token_text


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def completion_logprobs(ids: Sequence[int], entries: Sequence[TokenLogprobs | None], name: TokenText,
                        offset: int = 0) -> dict:
    """The legacy completions shape; a position without an entry (a prompt's first token) has nulls.

    `text_offset` counts characters from the start of the choice's returned text (`offset` is where this piece
    starts, for streamed chunks), token by token, as vLLM computes it.
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, e in zip(ids, entries, strict=True):
        text = name(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_lp(e.logprob))
        alternatives = {text: _lp(e.logprob)}  # the chosen token first, then by rank (vLLM's order)
        for t, lp in e.top:
            alternatives.setdefault(name(t), _lp(lp))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprobs], name: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = name(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def prompt_logprobs_json(entries: Sequence[TokenLogprobs | None], name: TokenText) -> list:
    """vLLM's prompt_logprobs: null first, then {token id: {logprob, rank, decoded_token}} per prompt token."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": name(e.token_id)}}
        for t, lp, rank in e.ranked_top():
            d.setdefault(str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": name(t)})
        out.append(d)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` when the prefix cache is on, as OpenAI reports it."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body
