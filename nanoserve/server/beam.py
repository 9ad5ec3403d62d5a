"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` is the beam width, and the answer is
the n best beams as its choices, whole (as vLLM, a stream is refused). The search (nanoserve.beam_search) runs
over engine requests of one token each, admitted as one Fanout per step, so each step's beams share the prefix
cache, are counted, and are aborted when the client leaves.

Beams are ranked by the model's raw logprobs, so the fields that shape sampling or its output one token at a time
(temperature, top_p, penalties, stop strings, logprobs, structured outputs, tools, ...) would change nothing: set,
they are refused by name (protocol.py, BEAM_QUIET).
"""

from __future__ import annotations

import itertools
import time

from starlette.requests import Request

from nanoserve.beam_search import Beam, BeamSearchParams, beam_search
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.context import APIError, RouteContext, off_loop, rendered_off_loop
from nanoserve.server.disconnect import unless_disconnected
from nanoserve.server.fanout import Fanout
from nanoserve.server.prompts import completion_prompts, rendered_chat
from nanoserve.server.responses import usage


def search_params(body, engine, prompt_len: int) -> BeamSearchParams:
    """The search one request asks for: n beams, each within the context (a 400 says what does not fit)."""
    room = engine.max_model_len - prompt_len
    limit = body.token_limit()
    max_tokens = room if limit is None else limit
    if max_tokens < 1:
        raise APIError(400, "a beam search generates at least one token; send max_tokens >= 1", param="max_tokens")
    if max_tokens > room:
        raise APIError(400, f"the prompt has {prompt_len} tokens and beams of {max_tokens} more would pass "
                            f"max_model_len {engine.max_model_len}; send fewer max_tokens, or a shorter prompt",
                       param="max_tokens")
    max_logprobs = engine.config.max_logprobs
    if body.allowed_token_ids is None and max_logprobs != -1 and 2 * body.n > max_logprobs:
        raise APIError(400, f"a beam search of width {body.n} reads the top {2 * body.n} logprobs a step, past this "
                            f"server's --max-logprobs {max_logprobs}; send n <= {max_logprobs // 2}", param="n")
    return BeamSearchParams(body.n, max_tokens, body.ignore_eos, 0.0, body.length_penalty or 1.0,
                            body.include_stop_str_in_output, body.skip_special_tokens,
                            tuple(body.allowed_token_ids or ()) or None)


class EngineSteps:
    """A search's steps as engine requests: one token for each beam, with the logprobs the search reads."""

    def __init__(self, ctx: RouteContext, body, rid: str):
        self.ctx, self.body, self.rid = ctx, body, rid
        self.steps = itertools.count()

    async def __call__(self, prompts: list[list[int]], alternatives: int, allowed) -> list:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False,
                                logprobs=alternatives, logprob_token_ids=allowed)
        fanout = Fanout(self.ctx.host, prompts, params, f"{self.rid}-step{next(self.steps)}")
        await fanout.open(self.body.user, self.body.cache_salt, self.body.session_id, streamed=False)
        async for _ in fanout.outputs():
            pass
        return [choice.completion.logprobs.entries()[0] for choice in fanout.choices]


async def search_all(ctx: RouteContext, body, engine, rid: str, prompts: list[list[int]]) -> list[list[Beam]]:
    """Each prompt's best beams (the prompts one after another: each search's steps are one batch already)."""
    ends = set(engine.tokenizer.eos_token_ids) | set(body.stop_token_ids or ())
    steps = EngineSteps(ctx, body, rid)
    searches = [search_params(body, engine, len(ids)) for ids in prompts]  # every prompt checked before any runs
    return [await beam_search(steps, ids, params, ends) for ids, params in zip(prompts, searches)]


def _text(engine, body, beam: Beam) -> str:
    """The beam's text, without its end token (kept in its token ids with include_stop_str_in_output, as vLLM)."""
    ended = beam.finish_reason == "stop" and body.include_stop_str_in_output
    tokens = beam.tokens[:-1] if ended else beam.tokens
    return engine.tokenizer.decode(tokens, skip_special_tokens=body.skip_special_tokens)


def _choice(body, beam: Beam, index: int) -> dict:
    return {"index": index, "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason, "logprobs": None,
            "token_ids": list(beam.tokens) if body.return_token_ids else None}


async def complete_with_beams(ctx: RouteContext, body, request: Request) -> dict:
    engine = ctx.host.serving()
    prompts = [ids for _, ids in await off_loop(completion_prompts, body, engine.tokenizer,
                                                engine.model_config.vocab_size, engine.max_model_len)]
    rid = ctx.request_id(body, "cmpl")
    found = await unless_disconnected(request, search_all(ctx, body, engine, rid, prompts))
    choices = [{**_choice(body, beam, p * body.n + i), "text": _text(engine, body, beam),
                "prompt_logprobs": None, "prompt_token_ids": list(prompts[p]) if body.return_token_ids else None}
               for p, beams in enumerate(found) for i, beam in enumerate(beams)]
    return _answer(rid, "text_completion", ctx.model_name, choices, prompts, found)


async def chat_with_beams(ctx: RouteContext, body, request: Request) -> dict:
    ctx.check_template_trusted(body.chat_template)
    engine = ctx.host.serving()
    _, ids = await rendered_off_loop(request, rendered_chat, body, engine.tokenizer, None, engine.max_model_len)
    rid = ctx.request_id(body, "chatcmpl")
    found = await unless_disconnected(request, search_all(ctx, body, engine, rid, [ids]))
    choices = [{**_choice(body, beam, i),
                "message": {"role": "assistant", "content": _text(engine, body, beam)}}
               for i, beam in enumerate(found[0])]
    answer = _answer(rid, "chat.completion", ctx.model_name, choices, [ids], found)
    return {**answer, "prompt_token_ids": list(ids) if body.return_token_ids else None}


def _answer(rid: str, kind: str, model: str, choices: list[dict], prompts: list[list[int]],
            found: list[list[Beam]]) -> dict:
    generated = sum(len(b.tokens) for beams in found for b in beams)
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(sum(len(p) for p in prompts), generated), "system_fingerprint": None,
            "service_tier": None}
