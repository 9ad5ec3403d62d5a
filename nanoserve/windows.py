"""RecentActivity: latency percentiles and per-second rates over sliding windows (the last 10 s, 1 min, 5 min).

The published latency percentiles cover the last N requests, which on a quiet server can be an hour old; an
operator watching a change wants what happened in the last seconds. The engine feeds every TTFT, TPOT, step time
and finish here with the time it happened; the snapshot reads each window back as nearest-rank percentiles and
rates. Samples older than the longest window are dropped as new ones arrive, and each kind keeps at most CAP.
"""

from __future__ import annotations

from collections import deque

WINDOWS = {"10s": 10.0, "1m": 60.0, "5m": 300.0}
CAP = 65536  # samples kept per kind (steps at 200/s fill five minutes with 60,000)


class _Timed:
    __slots__ = ("samples",)

    def __init__(self):
        self.samples: deque[tuple[float, object]] = deque(maxlen=CAP)

    def add(self, now: float, value) -> None:
        self.samples.append((now, value))
        horizon = now - max(WINDOWS.values())
        while self.samples and self.samples[0][0] < horizon:
            self.samples.popleft()

    def since(self, cutoff: float) -> list:
        return [v for t, v in self.samples if t >= cutoff]


class RecentActivity:
    def __init__(self):
        self._kinds = {"ttft": _Timed(), "tpot": _Timed(), "step": _Timed()}
        self._finishes = _Timed()

    def latency(self, kind: str, seconds: float, now: float) -> None:
        self._kinds[kind].add(now, seconds)

    def finished(self, reason: str, now: float) -> None:
        self._finishes.add(now, reason)

    def snapshot(self, now: float, started: float) -> dict:
        """Per window: p50/p99 of each latency in ms, and finishes per second by reason. A window longer than
        the engine has been up is measured over its uptime (`seconds` says over how long)."""
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
        return out


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    pick = lambda q: round(1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)  # noqa: E731
    return pick(0.5), pick(0.99)
