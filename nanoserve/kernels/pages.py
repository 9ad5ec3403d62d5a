"""Memory for packed weights: on Linux, anonymous pages advised to be huge (2 MiB) where the system allows it.

A decode step streams every weight once. On 4 KiB pages that stream crosses a page, and takes a TLB miss, every
4 KiB, and the hardware prefetchers stop at each page's end; torch's allocator asks for huge pages only under an
environment variable. A 3B Q4_K_M file's decode measured 15.0-15.6 tok/s on 4 KiB pages against 16.0 on huge
ones (Zen 4, 2 threads, alternating processes). Only the advice is new: the values and the kernels are the same,
and a system that refuses huge pages (THP "never") serves the same buffer on small ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

HUGE = 2 << 20  # an x86-64 / aarch64 (4 KiB base) transparent huge page


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 [nbytes] for a packed weight: a private anonymous mapping aligned to and advised for
    huge pages when it spans at least one, else torch's own allocation. Pages become resident as they are written
    (the pack writes them all at load)."""
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        pages = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE)  # room to start on a huge page's boundary
    except OSError:
        return torch.empty(nbytes, dtype=torch.uint8)  # no address space left for a mapping: torch says so if it can't
    base = torch.frombuffer(pages, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE
    pages.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE)
    return base[start:start + nbytes]


def release_free_heap() -> bool:
    """Hands the C heap's free memory back to the system (glibc's malloc_trim); False where there is no glibc.
    A load's transient copies (a file's rows concatenated, reordered, unpacked) are freed into the heap, and
    since the packed weights no longer come from that heap nothing reuses them: a 3B Q4_K_M load kept ~650 MiB
    of them resident."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
