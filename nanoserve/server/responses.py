"""Engine outputs -> OpenAI response and chunk JSON (completions and chat), logprobs included."""

from __future__ import annotations

import time

from nanoserve.outputs import RequestOutput


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(entries, tokenizer) -> dict:
    tokens, token_logprobs, top = [], [], []
    for e in entries:
        tokens.append(_token_text(tokenizer, e.token_id))
        token_logprobs.append(e.logprob)
        top.append({_token_text(tokenizer, t): lp for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": []}


def _chat_logprobs(entries, tokenizer) -> dict:
    def item(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_response(final: RequestOutput, rid: str, model: str, tokenizer, logprobs: int | None) -> dict:
    c = final.outputs[0]
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason,
                     "logprobs": _completion_logprobs(c.logprobs, tokenizer) if logprobs is not None else None}],
        "usage": final.usage,
    }


def completion_chunk(out: RequestOutput, rid: str, model: str, created: int, tokenizer, logprobs) -> dict:
    c = out.outputs[0]
    lp = None
    if logprobs is not None and c.logprobs:
        lp = _completion_logprobs(c.logprobs[len(c.logprobs) - len(out.delta_token_ids):], tokenizer)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.delta_text, "logprobs": lp,
                         "finish_reason": c.finish_reason if out.finished else None}]}


def chat_response(final: RequestOutput, rid: str, model: str, tokenizer, logprobs: int | None) -> dict:
    c = final.outputs[0]
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "logprobs": _chat_logprobs(c.logprobs, tokenizer) if logprobs is not None else None}],
        "usage": final.usage,
    }


def chat_chunk(out: RequestOutput, base: dict, tokenizer, logprobs: int | None) -> dict:
    c = out.outputs[0]
    lp = None
    if logprobs is not None and c.logprobs:
        lp = _chat_logprobs(c.logprobs[len(c.logprobs) - len(out.delta_token_ids):], tokenizer)
    return {**base, "choices": [{"index": 0, "delta": {"content": out.delta_text}, "logprobs": lp,
                                 "finish_reason": c.finish_reason if out.finished else None}]}
