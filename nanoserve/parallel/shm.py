"""SharedReduce: the all-reduces (and the logits' gather) of ranks that share one machine's memory, through a
mapped file instead of gloo.

gloo's all-reduce goes through TCP on loopback, and on a small CPU machine one of 576 floats takes about a
millisecond; a decode step of a 30-layer model runs 61 of them. Ranks on one machine can add their partial sums
where they all see them: each rank copies its partial into its own slot of a shared buffer, publishes a sequence
number, waits until every rank has published the same one, and adds the slots up in rank order (so every rank
gets the same bits). Two sets of slots alternate, so a rank that is one reduce ahead never writes where a slower
rank is still reading: to get two ahead it would need that rank's next number, published after its read.
A decode step's logits come to rank 0 the same way (each rank's slice in its slot; only rank 0 waits).

Waiting spins on the sequence numbers (yielding the core each turn); a rank that dies is noticed by the caller's
`alive` check or, failing that, by the timeout, so a wait never outlasts the group's timeout. The buffer is a
file in /dev/shm that rank 0 creates and unlinks once every rank has mapped it, so nothing is left behind.

x86-64 only: its stores are seen by other cores in program order, so a slot written before its sequence number
is complete when the number is seen. Elsewhere the group uses gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

CHECK_EVERY = 2048  # spins between liveness and timeout checks


class CollectiveTimeout(RuntimeError):
    """A rank did not reach the same all-reduce within the group's timeout."""


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def new_path() -> str:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"nanoserve-tp-{uuid.uuid4().hex}")


class SharedReduce:
    """`rank` of `world` over the shared file at `path` (rank 0 creates it), for reduces of up to `capacity`
    float32 elements and gathers to rank 0 of up to `gather_capacity` per rank."""

    def __init__(self, path: str, rank: int, world: int, capacity: int, timeout_s: float,
                 alive: Callable[[], str | None] | None = None, gather_capacity: int = 0):
        self.rank, self.world, self.capacity, self.timeout_s = rank, world, capacity, timeout_s
        self.gather_capacity = gather_capacity
        self.alive = alive or (lambda: None)
        flags_bytes = 4 * world * 8  # sequence numbers: reduce sides 0 and 1, gather sides 0 and 1
        reduce_bytes = 2 * world * capacity * 4
        size = flags_bytes + reduce_bytes + 2 * world * gather_capacity * 4
        if rank == 0:
            with open(path, "w+b") as f:
                f.truncate(size)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        flags = np.frombuffer(self._map, dtype=np.int64, count=4 * world).reshape(4, world)
        self.flags, self.gather_flags = flags[:2], flags[2:]
        slots = np.frombuffer(self._map, dtype=np.float32, offset=flags_bytes, count=reduce_bytes // 4)
        self.slots = torch.from_numpy(slots.reshape(2, world, capacity))
        gathered = np.frombuffer(self._map, dtype=np.float32, offset=flags_bytes + reduce_bytes,
                                 count=2 * world * gather_capacity)
        self.gather_slots = torch.from_numpy(gathered.reshape(2, world, gather_capacity))
        self.seq = self.gather_seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this reduce goes through the buffer (every rank decides alike: the shapes are the same)."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() <= self.capacity and \
            x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must be float32 on the CPU and fit)."""
        self.seq += 1
        side, n = self.seq % 2, x.numel()
        self.slots[side, self.rank, :n].copy_(x.view(-1))
        self.flags[side, self.rank] = self.seq
        self._wait(side)
        torch.sum(self.slots[side, :, :n], dim=0, out=x.view(-1))
        return x

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether this gather goes through the buffer (decided alike on every rank, from the shape)."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() <= self.gather_capacity and \
            x.is_contiguous()

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x joined along the last dimension, on rank 0 (None elsewhere). The other ranks do not
        wait: a rank reuses a side two gathers later, and every step's all-reduces lie between, which rank 0
        reaches only after it has read this one."""
        self.gather_seq += 1
        side, n = self.gather_seq % 2, x.numel()
        self.gather_slots[side, self.rank, :n].copy_(x.view(-1))
        self.gather_flags[side, self.rank] = self.gather_seq
        if self.rank:
            return None
        self._wait(side, self.gather_flags, self.gather_seq)
        parts = self.gather_slots[side, :, :n].view(self.world, *x.shape)
        return torch.cat(list(parts), dim=-1)

    def _wait(self, side: int, flags=None, seq: int | None = None) -> None:
        flags, seq = (self.flags if flags is None else flags)[side], self.seq if seq is None else seq
        spins = 0
        started = None
        while flags.min() < seq:
            spins += 1
            if spins % CHECK_EVERY == 0:
                started = started or time.monotonic()
                failed = self.alive()
                if failed:
                    raise RuntimeError(failed)
                if time.monotonic() - started > self.timeout_s:
                    late = [r for r in range(self.world) if flags[r] < seq]
                    raise CollectiveTimeout(f"ranks {late} did not reach all-reduce {seq} within {self.timeout_s:g} s")
            os.sched_yield()

    def close(self) -> None:
        self.slots = self.flags = self.gather_slots = self.gather_flags = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
