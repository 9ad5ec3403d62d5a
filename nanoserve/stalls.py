"""StallWatch: a step far slower than the steps before it, caught as it happens, with what the step carried.

A step is a stall when it takes over FACTOR times the p99 of the last WINDOW steps (and at least MIN_SECONDS, so
microsecond jitter on an idle engine is not one). Each stall is kept with the step's composition (decode rows,
prefill tokens, preemptions) and the wall time, so an operator sees why it was slow: a long prefill chunk, a
burst of preemptions, or neither (the machine itself).
"""

from __future__ import annotations

import time
from collections import deque

FACTOR = 3.0
MIN_SECONDS = 0.05
WINDOW = 256  # steps the p99 is taken over
WARMUP = 32  # steps before any is judged
KEPT = 8  # latest stalls published


class StallWatch:
    def __init__(self):
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._p99: float | None = None
        self._seen = 0
        self.count = 0
        self.latest: deque[dict] = deque(maxlen=KEPT)

    def step(self, seconds: float, decode_rows: int, prefill_tokens: int, preemptions: int) -> bool:
        """Judge one step against the ones before it (then add it); True when it was a stall."""
        self._seen += 1
        if self._seen % 16 == 1 or self._p99 is None:  # re-sorted every 16 steps, not every step
            ordered = sorted(self._steps)
            self._p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else None
        stalled = (len(self._steps) >= WARMUP and self._p99 is not None
                   and seconds > max(FACTOR * self._p99, MIN_SECONDS))
        if stalled:
            self.count += 1
            self.latest.append({"at": time.strftime("%H:%M:%S"), "step_ms": round(1000 * seconds, 1),
                                "p99_ms": round(1000 * self._p99, 1), "decode_rows": decode_rows,
                                "prefill_tokens": prefill_tokens, "preemptions": preemptions})
        self._steps.append(seconds)
        return stalled

    def as_dict(self) -> dict:
        return {"stalls": self.count, "factor": FACTOR, "latest": list(self.latest)}
