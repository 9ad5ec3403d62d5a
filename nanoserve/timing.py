"""The one timing rule the engine and the benchmarks share: the fastest of a few calls, after a warm-up."""

from __future__ import annotations

import time


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
