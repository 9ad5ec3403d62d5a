"""Resident memory as the benchmarks report it: now, after glibc hands back its free arenas, and the peak over a
stretch of work (sampled, since the process's own high-water mark cannot be reset between arms)."""

from __future__ import annotations

import os
import threading


def resident_mib(pid: int | str = "self") -> float:
    """A process's resident memory, this one's by default (Linux /proc; 0 elsewhere, or once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def trimmed_resident_mib() -> float:
    """Resident memory after glibc has handed its free arenas back (malloc_trim): what is really held, as
    opposed to what the allocator keeps for reuse. Plain resident memory where glibc is absent."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return resident_mib()


class PeakRss:
    """`with PeakRss() as peak: ...` then `peak.mib`: the most resident memory seen inside the block, sampled
    every `every` seconds by a thread (ru_maxrss is the whole process's peak and never comes down, so it cannot
    tell one arm of a benchmark from the arm before it)."""

    def __init__(self, every: float = 0.01):
        self.every, self.mib = every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.mib = max(self.mib, resident_mib())
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> PeakRss:
        self.mib = resident_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.mib = max(self.mib, resident_mib())
