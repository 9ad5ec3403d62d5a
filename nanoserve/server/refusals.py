"""Refusals: generation requests the server turned away, by HTTP status, as totals and per second over the
sliding windows (the `refusals` section of the stats snapshot).

A refusal never reaches the engine (a 400 for a bad field, 401 for a key, 404 for a model, 413 for a body, 429
or 503 for a full queue or a stop), so the engine's own counters cannot see it: the HTTP layer counts it here,
as its status goes out. A 500 is not a refusal: it is a step that failed, already counted as finish reason
`error`. The host owns the count, so it spans restarts as the server does.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

from nanoserve.windows import CAP, WINDOWS

ROUTES = ("/v1/completions", "/v1/chat/completions")  # the routes whose refusals are counted
# the reason vllm:admission_rejections_total gives a request that --max-waiting turned away (vLLM's own limits,
# max_num_queued_reqs and max_num_queued_tokens, count differently, so the label names the limit that did it)
ADMISSION_LIMIT = "max_waiting"


class Refusals:
    def __init__(self):
        self._lock = threading.Lock()  # the event loop adds, any thread reads
        self._times: deque[float] = deque(maxlen=CAP)
        self.by_status: dict[int, int] = {}
        self.by_admission_limit: dict[str, int] = {}  # the queue limit that turned a request away (vLLM's reason)
        self._started = time.monotonic()

    def refused(self, status: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.by_status[status] = self.by_status.get(status, 0) + 1
            self._times.append(now)
            horizon = now - max(WINDOWS.values())
            while self._times and self._times[0] < horizon:
                self._times.popleft()

    def rejected_at_admission(self, limit: str) -> None:
        """A request the engine's queue limit turned away (its 503 is also counted by status, as it goes out)."""
        with self._lock:
            self.by_admission_limit[limit] = self.by_admission_limit.get(limit, 0) + 1

    def snapshot(self, now: float | None = None) -> dict:
        """Totals by status, and refusals per second over each window (over the uptime while it is shorter)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times, by_status, admission = list(self._times), dict(self.by_status), dict(self.by_admission_limit)
        per_s = {}
        for name, length in WINDOWS.items():
            span = max(min(length, now - self._started), 1e-9)
            per_s[name] = round((len(times) - bisect.bisect_left(times, now - length)) / span, 3)
        return {"total": sum(by_status.values()), "by_status": {str(k): v for k, v in sorted(by_status.items())},
                "per_s": per_s, "admission": admission}


class CountRefusals:
    """A pure ASGI middleware: the status of every answer on ROUTES, counted when it is a refusal (4xx, or a
    5xx other than 500). It sees the status as it is sent, so the guard's own answers (401, 413) count too."""

    def __init__(self, app, refusals: Refusals):
        self.app, self.refusals = app, refusals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start" and message["status"] >= 400 and message["status"] != 500:
                self.refusals.refused(message["status"])
            await send(message)

        return await self.app(scope, receive, counted)
