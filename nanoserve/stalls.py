"""StallWatch: a step far slower than the steps before it, or decode throughput falling while the load did not,
caught as it happens, with what the engine was carrying.

Two criteria, each kept with the composition at that moment (decode rows, prefill tokens, preemptions) and the
wall time, so an operator sees why: a long prefill chunk, a burst of preemptions, or neither (the machine).
- A **slow step** takes over `factor` times the p99 of the last WINDOW steps (and at least MIN_SECONDS, so
  microsecond jitter on an idle engine is not one).
- A **throughput drop**: decode tokens per second over a BUCKET_S stretch of busy time falls below `drop_fraction`
  of the median of the last DROP_HISTORY stretches, while the stretch decoded at least as many rows per step as
  those did (fewer requests running is less throughput, not a stall). Busy time runs from the end of a step
  that left requests running to the end of the next, so a delay between steps (the loop starved of the CPU)
  counts, and an idle engine does not. Every step can be fast and the engine still slow this way.

Each entry names the requests it carried (`requests`: sequence names, the Requests table's keys), so the console
can list them: a slow step's own, a drop's union over its stretch, at most STRETCH_IDS (then `requests_cut`), so
that following every step stays cheap.
"""

from __future__ import annotations

import time
from collections import deque

FACTOR = 3.0  # the thresholds' defaults: --stall-factor and --stall-drop-fraction set them, live knobs both
MIN_SECONDS = 0.05
WINDOW = 256  # steps the p99 is taken over
WARMUP = 32  # steps before any is judged
KEPT = 8  # latest stalls published
BUCKET_S = 1.0  # busy seconds a throughput stretch covers
DROP_FRACTION = 0.5
DROP_HISTORY = 30  # stretches the median is taken over
DROP_WARMUP = 5  # stretches before any is judged
LOAD_KEPT = 0.9  # the stretch's decode rows per step, at least this share of the median's, for a drop to count
STRETCH_IDS = 64  # request names a throughput stretch keeps; past it the entry says requests_cut


class StallWatch:
    def __init__(self, factor: float = FACTOR, drop_fraction: float = DROP_FRACTION):
        self.factor, self.drop_fraction = factor, drop_fraction  # the thresholds: live knobs, read each step
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._p99: float | None = None
        self._seen = 0
        self.count = 0
        self.drops = 0
        self.latest: deque[dict] = deque(maxlen=KEPT)
        self._stretches: deque[tuple[float, float]] = deque(maxlen=DROP_HISTORY)  # (decode tok/s, rows per step)
        self._stretch: dict | None = None
        self._last_end: float | None = None
        self._last_running = 0

    def step(self, seconds: float, decode_rows: int, prefill_tokens: int, preemptions: int, running: int = 0,
             now: float | None = None, prefill_requests: tuple[str, ...] = (),
             requests: tuple[str, ...] = ()) -> bool:
        """Judge one step that ended at `now` and left `running` requests running; True when it was a slow step
        or closed a stretch whose throughput dropped. A slow step names the requests whose prompts it read
        (`prefill_requests`) and every request it carried (`requests`: decode rows and prefill chunks)."""
        now = time.monotonic() if now is None else now
        slow = self._judge_step(seconds, decode_rows, prefill_tokens, preemptions, prefill_requests, requests)
        dropped = self._follow_throughput(now, seconds, decode_rows, prefill_tokens, preemptions, requests)
        self._last_end, self._last_running = now, running
        return slow or dropped

    def _judge_step(self, seconds: float, decode_rows: int, prefill_tokens: int, preemptions: int,
                    prefill_requests: tuple[str, ...] = (), requests: tuple[str, ...] = ()) -> bool:
        self._seen += 1
        if self._seen % 16 == 1 or self._p99 is None:  # re-sorted every 16 steps, not every step
            ordered = sorted(self._steps)
            self._p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else None
        stalled = (len(self._steps) >= WARMUP and self._p99 is not None
                   and seconds > max(self.factor * self._p99, MIN_SECONDS))
        if stalled:
            self.count += 1
            self.latest.append({"kind": "step", "at": time.strftime("%H:%M:%S"), "step_ms": round(1000 * seconds, 1),
                                "p99_ms": round(1000 * self._p99, 1), "decode_rows": decode_rows,
                                "prefill_tokens": prefill_tokens, "preemptions": preemptions,
                                "prefill_requests": list(prefill_requests), "requests": list(requests)})
        self._steps.append(seconds)
        return stalled

    def _follow_throughput(self, now: float, seconds: float, decode_rows: int, prefill_tokens: int,
                           preemptions: int, requests: tuple[str, ...] = ()) -> bool:
        busy_since = self._last_end if self._last_running and self._last_end is not None else now - seconds
        stretch = self._stretch
        if stretch is None or not self._last_running:  # a fresh start: an idle engine owes no throughput
            stretch = self._stretch = {"start": busy_since, "tokens": 0, "steps": 0, "prefill": 0, "preempted": 0,
                                       "requests": set(), "cut": False}
        stretch["tokens"] += decode_rows
        stretch["steps"] += 1 if decode_rows else 0
        stretch["prefill"] += prefill_tokens
        stretch["preempted"] += preemptions
        if requests and not stretch["cut"]:
            _gather(stretch, requests)
        span = now - stretch["start"]
        if span < BUCKET_S:
            return False
        self._stretch = None
        if not stretch["steps"]:
            return False  # all prefill: no decode throughput to judge
        rate, rows = stretch["tokens"] / span, stretch["tokens"] / stretch["steps"]
        dropped = False
        if len(self._stretches) >= DROP_WARMUP:
            median_rate = sorted(r for r, _ in self._stretches)[len(self._stretches) // 2]
            median_rows = sorted(n for _, n in self._stretches)[len(self._stretches) // 2]
            dropped = rate < self.drop_fraction * median_rate and rows >= LOAD_KEPT * median_rows
            if dropped:
                self.drops += 1
                self.latest.append({"kind": "throughput", "at": time.strftime("%H:%M:%S"),
                                    "decode_tok_s": round(rate, 1), "median_tok_s": round(median_rate, 1),
                                    "decode_rows": round(rows, 1), "prefill_tokens": stretch["prefill"],
                                    "preemptions": stretch["preempted"], "seconds": round(span, 2),
                                    "requests": sorted(stretch["requests"]), "requests_cut": stretch["cut"]})
        self._stretches.append((rate, rows))
        return dropped

    def as_dict(self) -> dict:
        return {"stalls": self.count, "factor": self.factor, "throughput_drops": self.drops,
                "drop_fraction": self.drop_fraction, "latest": list(self.latest)}


def _gather(stretch: dict, requests: tuple[str, ...]) -> None:
    """Add a step's requests to its stretch's set, the first STRETCH_IDS seen; one more marks it cut, and no
    later step adds any."""
    names = stretch["requests"]
    if len(names) + len(requests) <= STRETCH_IDS:
        names.update(requests)
        return
    for name in requests:
        if name not in names:
            if len(names) >= STRETCH_IDS:
                stretch["cut"] = True
                return
            names.add(name)
