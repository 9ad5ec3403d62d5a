"""What /health reports: serving, stopped, failing repeatedly (with the reason), or failed to load.

One failed step is contained (its requests end with an error, the engine serves on), so it does not make the
server unhealthy by itself. Failures that repeat do: a load balancer should stop sending work to an engine
that fails step after step, and an operator should see why without reading the log.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

ECHO_CHARS = 400  # of an exception's text said back: it may quote a request (a grammar, a prompt) at any length


def bounded(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


REPEATS = 3  # failed steps within WINDOW_S that make the engine unhealthy
WINDOW_S = 60.0


@dataclass(frozen=True)
class Health:
    status: str  # "ok" | "unhealthy" | "stopped" | "failed"
    reason: str | None = None
    detail: str | None = None  # the latest failure's own text: it may quote a caller's request, so keyed only

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class FailureLog:
    """Failed steps in the last WINDOW_S seconds, and the latest failure's message."""

    def __init__(self, repeats: int = REPEATS, window_s: float = WINDOW_S, clock=time.monotonic):
        self.repeats, self.window_s, self._clock = repeats, window_s, clock
        self._times: deque[float] = deque()
        self.total = 0
        self.last: str | None = None

    def record(self, error: BaseException) -> None:
        self._times.append(self._clock())
        self.total += 1
        self.last = f"{type(error).__name__}: {bounded(str(error))}"

    def recent(self) -> int:
        cutoff = self._clock() - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
        return len(self._times)

    def health(self) -> Health:
        n = self.recent()
        if n >= self.repeats:
            return Health("unhealthy", f"{n} engine steps failed in the last {self.window_s:.0f} s",
                          f"the latest: {self.last}")
        return Health("ok")
