"""BlockPool: which KV blocks are free and who holds the rest.

Block 0 is the null block: it is never handed out, so a padded row can always write there without
touching a live sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

NULL_BLOCK = 0


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler checks first)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcounts = [0] * num_blocks
        self.refcounts[NULL_BLOCK] = 1
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks a request can ever hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcounts[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b == NULL_BLOCK or self.refcounts[b] <= 0:
                raise RuntimeError(f"block {b} freed while not held (refcount {self.refcounts[b]})")
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self._free.append(b)

    def audit(self, owners: Mapping[str, Iterable[int]]) -> None:
        """Prove every block is either free or held by a live owner, with matching refcounts.

        `owners` maps each live request id to the blocks it holds. Raises AssertionError naming the first
        block that is leaked, double-freed or over-counted.
        """
        held = [0] * self.num_blocks
        for owner, blocks in owners.items():
            for b in blocks:
                assert b != NULL_BLOCK, f"request {owner} holds the null block"
                held[b] += 1
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert NULL_BLOCK not in free, "the null block is on the free list"
        free_set = set(free)
        for b in range(1, self.num_blocks):
            if b in free_set:
                assert held[b] == 0, f"block {b} is free but held by a live request"
                assert self.refcounts[b] == 0, f"block {b} is free with refcount {self.refcounts[b]}"
            else:
                assert held[b] > 0, f"block {b} is neither free nor held by a live request (leaked)"
                assert self.refcounts[b] == held[b], (
                    f"block {b} has refcount {self.refcounts[b]} but {held[b]} holders"
                )
