"""OutputCollector: one request's outputs between the engine thread and its reader, in bounded memory.

The engine emits an output per step whether or not the reader keeps up. Queued one by one, a reader that
stalls (a slow network, a paused client) holds every step's output for as long as it stalls. The collector
keeps at most one pending output per completion instead: an output that arrives while an older one of the
same completion is unread is merged into it (the deltas concatenated, the latest state kept), as vLLM's
output collector does. The reader sees every token and every character, in order, however slow it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from nanoserve.outputs import RequestOutput


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output saying what both said: the newer state, with both steps' deltas."""
    return dataclasses.replace(
        newer, delta_text=older.delta_text + newer.delta_text,
        delta_token_ids=older.delta_token_ids + newer.delta_token_ids,
        prompt_logprobs=newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs,
    )


class OutputCollector:
    """Filled on the event loop (the engine thread hands items over with call_soon_threadsafe), read by one
    task. An exception put in ends the stream after what came before it."""

    def __init__(self):
        self._pending: dict[int, RequestOutput] = {}  # completion index -> unread output, oldest first
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.merged = 0  # outputs folded into an unread one (how far the reader fell behind)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            index = item.outputs[0].index
            older = self._pending.pop(index, None)  # re-inserted last: the request's final output stays last
            if older is not None:
                item = merge(older, item)
                self.merged += 1
            self._pending[index] = item
        self._ready.set()

    def __len__(self) -> int:
        return len(self._pending)

    async def get(self) -> RequestOutput:
        """The oldest unread output; raises the exception put in once every output before it was read."""
        while not self._pending and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending:
            index = next(iter(self._pending))
            return self._pending.pop(index)
        raise self._error


async def relay(outputs: OutputCollector, abandon: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs as its route reads them, until its final one; an exception put in is raised. A reader
    that stops before the end (a client gone) calls `abandon`, which aborts the request."""
    finished = False
    try:
        while not finished:
            item = await outputs.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abandon()
