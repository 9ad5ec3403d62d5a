"""Responses run in the background (`background: true`, OpenAI's and vLLM's): the request is answered at once with
the response `queued`, the reply runs on as an asyncio task, and the store shows its state as it goes
(`in_progress`, then `completed`, `incomplete`, `failed` or `cancelled`). `GET /v1/responses/{id}` reads it;
`POST /v1/responses/{id}/cancel` stops it (its engine request aborted, its blocks freed at once).

A background stream (`stream: true` too) keeps every event it sent, numbered, so the client that created it, or
any other, reads it again from the start or from after a sequence number (`GET ...?stream=true&starting_after=N`);
the events live while the stored response does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from nanoserve.server.response_store import ResponseStore

ACTIVE = ("queued", "in_progress")  # the states a background response can be cancelled in


class EventLog:
    """A background stream's events as they come, numbered, for any number of readers."""

    def __init__(self):
        self.events: list[dict] = []
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, event: dict) -> None:
        self.events.append({**event, "sequence_number": len(self.events)})
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, starting_after: int | None = None) -> AsyncIterator[dict]:
        """Every event after `starting_after` (all of them for None), as they come, until the stream ended."""
        at = 0 if starting_after is None else starting_after + 1
        while True:
            changed = self._changed
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await changed.wait()


class BackgroundRuns:
    """The background responses of one app: their tasks while they run, and their streams' events."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}
        self.logs: dict[str, EventLog] = {}

    def start_whole(self, response_id: str, whole: Callable[[], object], failed: Callable[[str], None]) -> None:
        """Run `whole()` (which stores the finished response) as the response's task."""
        self._start(response_id, self._run(whole(), failed))

    def start_stream(self, response_id: str, events: AsyncIterator[dict], failed: Callable[[str], None]) -> EventLog:
        """Run the response's event stream as its task, every event kept in the log returned."""
        self._prune()
        log = self.logs[response_id] = EventLog()

        async def pump():
            try:
                async for event in events:
                    log.add(event)
            except Exception as e:  # readers are told, as a foreground stream tells its client
                log.add({"type": "error", "code": "server_error", "message": str(e), "param": None})
                raise
            finally:
                log.end()

        self._start(response_id, self._run(pump(), failed))
        return log

    def _start(self, response_id: str, work) -> None:
        task = asyncio.get_running_loop().create_task(work, name=f"background {response_id}")
        self.tasks[response_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(response_id, None))

    @staticmethod
    async def _run(work, failed: Callable[[str], None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the response says it failed, and why
            failed(str(e) or type(e).__name__)

    async def cancel(self, response_id: str) -> bool:
        """Stop a running response's task (its request aborted); False when none runs."""
        task = self.tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    def _prune(self) -> None:
        """Forget the events of streams whose response the store no longer keeps."""
        for response_id in [r for r in self.logs if r not in self.tasks and self.store.get(r) is None]:
            del self.logs[response_id]


def sse_of(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Already numbered events as the Responses API's server-sent events."""
    async def body():
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    return body()
