"""Fanout: the engine requests behind one HTTP request (one per prompt, each with n sequences) as one stream.

A batch of prompts or n > 1 gives several OpenAI choices; choice `prompt * n + i` is completion i of that prompt
(vLLM's numbering). Opening is all-or-nothing: a refused prompt closes the ones already opened, so nothing is
held. Closing the fanout (the response finished, or the client went away) aborts every request still running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from nanoserve.errors import NanoserveError
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.host import EngineHost
from nanoserve.server.request_timing import timing_metrics


@dataclass
class Choice:
    index: int
    prompt: int  # which prompt of the request
    completion: CompletionOutput | None = None  # the latest state of this choice
    sent_logprobs: int = 0  # logprob entries already streamed
    sent_chars: int = 0  # characters already streamed (text_offset of the next piece)
    sent_tokens: int = 0  # generated token ids already streamed (return_token_ids)
    started: bool = False  # a first chunk (role, or echoed prompt) was sent
    called_tools: bool = False  # a tool call was streamed (its finish reason is then "tool_calls")


class Fanout:
    def __init__(self, host: EngineHost, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 cached_details: bool = False, timed: bool = False):
        """`cached_details`: OpenAI usage carries prompt_tokens_details (--enable-prompt-tokens-details);
        `timed`: a one-sequence answer carries vLLM's per-request `metrics` (--enable-per-request-metrics)."""
        self.host, self.prompts, self.params, self.request_id = host, prompts, params, request_id
        self.cached_details, self.timed = cached_details, timed
        self.timings: list = [None] * len(prompts)  # per prompt, its latest RequestMetrics
        self.choices = [Choice(p * params.n + i, p) for p in range(len(prompts)) for i in range(params.n)]
        self.prompt_logprobs: list = [None] * len(prompts)  # per prompt, once its prefill is done
        self.cached_tokens: list[int | None] = [None] * len(prompts)  # per prompt, from the prefix cache
        self.written_tokens: list[int | None] = [None] * len(prompts)  # per prompt, into the prefix cache
        self._streams: list = []

    def engine_id(self, prompt: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt}"

    async def open(self, user: str | None = None, cache_salt: str | None = None,
                   session_id: str | None = None, streamed: bool = True) -> Fanout:
        """Submit every prompt (a refusal raises here, before any response is started, and frees the rest)."""
        try:
            for p, ids in enumerate(self.prompts):
                self._streams.append(await self.host.open(ids, self.params, request_id=self.engine_id(p), user=user,
                                                            cache_salt=cache_salt, session_id=session_id,
                                                            streamed=streamed))
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        for stream in self._streams:
            await stream.aclose()  # a request not yet finished is aborted

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each engine output with the choice it moved, in arrival order; closes everything at the end."""
        try:
            async for p, out in _merged(self._streams):
                choice = self.choices[p * self.params.n + out.outputs[0].index]
                choice.completion = out.outputs[0]
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[p] = out.prompt_logprobs
                if out.num_cached_tokens is not None:
                    self.cached_tokens[p] = out.num_cached_tokens
                if out.metrics is not None:
                    self.timings[p] = out.metrics
                if out.num_cache_written_tokens is not None:
                    self.written_tokens[p] = out.num_cache_written_tokens
                yield choice, out
        finally:
            await self.close()

    def token_counts(self) -> tuple[int, int, int | None, int | None]:
        """(prompt tokens, completion tokens, prompt tokens served from the prefix cache, prompt tokens written into
        it) so far, the last two None while caching is off: each prompt counted once, every choice's tokens."""
        completion = sum(len(c.completion.token_ids) for c in self.choices if c.completion is not None)
        cached = [c for c in self.cached_tokens if c is not None]
        written = [w for w in self.written_tokens if w is not None]
        return (sum(len(ids) for ids in self.prompts), completion, sum(cached) if cached else None,
                sum(written) if written else None)

    def usage_counts(self) -> tuple[int, int, int | None]:
        """(prompt tokens, completion tokens, cached_tokens for OpenAI's usage.prompt_tokens_details): the last is
        None unless --enable-prompt-tokens-details, and 0 under it while the prefix cache is off, as vLLM says."""
        prompt, completion, cached, _ = self.token_counts()
        return prompt, completion, (cached or 0) if self.cached_details else None

    def timing_field(self) -> dict:
        """{"metrics": ...} for an answer of one sequence under --enable-per-request-metrics, else {}."""
        if not self.timed or len(self.prompts) != 1 or self.params.n != 1:
            return {}
        completion = self.choices[0].completion
        return {"metrics": timing_metrics(self.timings[0], len(completion.token_ids) if completion else 0)}

    def new_token_ids(self, choice: Choice) -> list[int]:
        """The generated ids of `choice` not yet streamed (return_token_ids), marked as streamed."""
        ids = list(choice.completion.token_ids[choice.sent_tokens:]) if choice.completion is not None else []
        choice.sent_tokens += len(ids)
        return ids


async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their items arrive (one stream is read directly)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # the engine failed this request: end the whole response with it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events, ending with [DONE] however the events end."""
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # headers are gone: say so in the stream itself, then end it properly
            kind, code = ("invalid_request_error", 400) if isinstance(e, NanoserveError) else ("server_error", 500)
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': kind, 'code': code}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
