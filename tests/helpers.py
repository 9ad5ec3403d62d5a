"""Small helpers shared by tests that watch a live engine thread or server."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 10.0, every: float = 0.02) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; tests assert on the result instead of sleeping."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False
