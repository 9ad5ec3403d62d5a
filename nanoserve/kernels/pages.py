"""Memory for packed weights: anonymous pages moved onto huge (2 MiB) pages after load, where the system allows it.

A decode step streams every weight once. On 4 KiB pages that stream takes a TLB miss every 4 KiB; on huge pages
one-row calls streamed 5-8% more bytes a second (scripts/weight-pages-ab.py, Zen 4, 2 threads). Faulting huge
pages in as the weights are packed made a load slower by 0.2-1.9 s where the system backs fresh memory lazily (a
virtual machine's first touch of a 2 MiB block: 1B Q4_0 0.63 -> 0.80-1.26 s), so the weights are packed on
small pages, each buffer aligned to a huge page, and a background thread then asks the kernel to move them
(madvise MADV_COLLAPSE, Linux 6.1) while the engine already serves. Only the pages change: the values, the
kernels and their bits are the same, and where the kernel cannot move them the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading

import torch

HUGE = 2 << 20  # an x86-64 / aarch64 (4 KiB base) transparent huge page
MADV_COLLAPSE = 25  # linux/mman.h; not in Python's mmap module before 3.13
STEP = 32 << 20  # bytes one madvise call asks to move: the thread lets go of the CPU between steps
NICE = 10  # the mover's niceness: a tenth of a busy core's time, all of an idle one


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 [nbytes] for a packed weight: a private anonymous mapping starting on a huge page's
    boundary when it spans at least one (so HugePageMover can move whole huge pages of it), else torch's own
    allocation. Pages become resident as they are written (the pack writes them all at load)."""
    if nbytes < HUGE or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        pages = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE)  # room to start on a huge page's boundary
    except OSError:
        return torch.empty(nbytes, dtype=torch.uint8)  # no address space for a mapping: torch's, or its error
    base = torch.frombuffer(pages, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE
    return base[start:start + nbytes]


def huge_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of the whole huge pages inside the model's packed weights (uint8 buffers)."""
    spans, seen = [], set()
    for buffer in model.buffers():
        if buffer.dtype is not torch.uint8 or buffer.numel() < HUGE or buffer.data_ptr() in seen:
            continue
        seen.add(buffer.data_ptr())
        start = buffer.data_ptr() + (-buffer.data_ptr() % HUGE)
        whole = (buffer.data_ptr() + buffer.numel() - start) // HUGE * HUGE
        if whole > 0:
            spans.append((start, whole))
    return spans


class HugePageMover:
    """Moves a loaded model's packed weights onto huge pages in a daemon thread (`start`); `status()` says how far:
    bytes asked for, moved, and why it stopped early. Holds the model's buffers until it is done, so no address it
    names is freed meanwhile."""

    def __init__(self, model: torch.nn.Module):
        self.buffers = [b for b in model.buffers() if b.dtype is torch.uint8 and b.numel() >= HUGE]
        self.spans = huge_spans(model)
        self.total = sum(n for _, n in self.spans)
        self.moved = self.asked = 0
        self.stopped = ""  # why it stopped before the end, if it did
        self.done = threading.Event()

    def start(self) -> HugePageMover:
        reason = self.unavailable()
        if reason or not self.spans:
            self.stopped = reason
            self.buffers = []
            self.done.set()
            return self
        threading.Thread(target=self._run, name="nanoserve-huge-pages", daemon=True).start()
        return self

    @staticmethod
    def unavailable() -> str:
        """Why this system cannot move pages onto huge ones, or ""."""
        if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
            return "no transparent huge pages on this system"
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off (enabled: never)"
        return ""

    def _run(self) -> None:
        if hasattr(os, "setpriority"):  # Linux: a thread's own niceness, so the load and the serving go first
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except OSError:
                pass
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
        madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        try:
            for address, nbytes in self.spans:
                for at in range(0, nbytes, STEP):
                    length = min(STEP, nbytes - at)
                    self.asked += length
                    if madvise(address + at, length, MADV_COLLAPSE) == 0:
                        self.moved += length
                    elif ctypes.get_errno() == errno.EINVAL:
                        self.stopped = "this kernel has no MADV_COLLAPSE (Linux 6.1)"
                        return
        finally:
            self.buffers = []
            self.done.set()

    def status(self) -> dict:
        return {"weight_bytes": self.total, "asked_bytes": self.asked, "moved_bytes": self.moved,
                "done": self.done.is_set(), "stopped": self.stopped}


def release_free_heap() -> bool:
    """Hands the C heap's free memory back to the system (glibc's malloc_trim); False where there is no glibc.
    A load's transient copies (a file's rows reordered, unpacked) are freed into the heap, and since the packed
    weights do not come from that heap nothing reuses them: a 3B Q4_K_M load kept ~650 MiB of them resident."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
