"""RecentActivity: latency percentiles and per-second rates over sliding windows (the last 10 s, 1 min, 5 min).

The published latency percentiles cover the last N requests, which on a quiet server can be an hour old; an
operator watching a change wants what happened in the last seconds. The engine feeds every TTFT, TPOT, step time
and finish here with the time it happened; the snapshot reads each window back as nearest-rank percentiles and
rates. Samples older than the longest window are dropped as new ones arrive, and each kind keeps at most CAP.

The host takes a stats snapshot after every step, on the engine thread, so the windows are worked out at most
once every RECOMPUTE_S seconds (a window of 10 s or more moves little in one), each by bisecting its samples'
times rather than walking them.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import islice

WINDOWS = {"10s": 10.0, "1m": 60.0, "5m": 300.0}
CAP = 65536  # samples kept per kind (steps at 200/s fill five minutes with 60,000)
RECOMPUTE_S = 1.0


class _Timed:
    """Times (in arrival order, so sorted) and values, in two deques of the same length."""

    __slots__ = ("times", "values")

    def __init__(self):
        self.times: deque[float] = deque(maxlen=CAP)
        self.values: deque = deque(maxlen=CAP)

    def add(self, now: float, value) -> None:
        self.times.append(now)
        self.values.append(value)
        horizon = now - max(WINDOWS.values())
        while self.times and self.times[0] < horizon:
            self.times.popleft()
            self.values.popleft()

    def since(self, cutoff: float) -> list:
        return list(islice(self.values, bisect.bisect_left(self.times, cutoff), None))


class RecentActivity:
    def __init__(self):
        self._kinds = {"ttft": _Timed(), "tpot": _Timed(), "step": _Timed()}
        self._finishes = _Timed()
        self._cached: tuple[float, dict] | None = None

    def latency(self, kind: str, seconds: float, now: float) -> None:
        self._kinds[kind].add(now, seconds)

    def finished(self, reason: str, now: float) -> None:
        self._finishes.add(now, reason)

    def snapshot(self, now: float, started: float) -> dict:
        """Per window: p50/p99 of each latency in ms, and finishes per second by reason. A window longer than
        the engine has been up is measured over its uptime (`seconds` says over how long). Worked out again only
        when the last answer is RECOMPUTE_S old."""
        if self._cached is not None and 0 <= now - self._cached[0] < RECOMPUTE_S:
            return self._cached[1]
        out = {}
        for name, length in WINDOWS.items():
            span = max(min(length, now - started), 1e-9)
            cutoff = now - length
            window: dict = {"seconds": round(span, 1)}
            for kind, samples in self._kinds.items():
                p50, p99 = _percentiles(samples.since(cutoff))
                window[f"{kind}_p50_ms"], window[f"{kind}_p99_ms"] = p50, p99
            reasons: dict[str, int] = {}
            for reason in self._finishes.since(cutoff):
                reasons[reason] = reasons.get(reason, 0) + 1
            window["finished_per_s"] = {reason: round(n / span, 3) for reason, n in sorted(reasons.items())}
            out[name] = window
        self._cached = (now, out)
        return out


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    pick = lambda q: round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)  # noqa: E731
    return pick(0.5), pick(0.99)
