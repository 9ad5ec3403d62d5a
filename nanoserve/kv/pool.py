"""BlockPool: which KV blocks are free, who holds the rest, and which full blocks are named by their content.

Block 0 is the null block: it is never handed out, so a padded row can always write there without
touching a live sequence.

With prefix caching a full block is cached under its content name (kv/prefix.py) as soon as the step that
fills it is scheduled, so a request admitted later, in the same step too, shares it instead of computing it
again (within a step every layer writes all new K/V before any attention reads). A freed block keeps its
content and name until the pool needs it: free blocks form a least-recently-freed queue, a request's blocks
are freed tail first, so a sequence's tail is evicted before its head. A hit is taken only when the stored
tokens and the parent block (by id and caching generation) match, whatever the hash says.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

NULL_BLOCK = 0
ROOT = (NULL_BLOCK, -1)  # the parent of a sequence's first block


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler checks first)."""


@dataclass(frozen=True)
class Cached:
    """What a cached block holds: its name, its tokens, and its parent (block id, generation)."""

    name: bytes
    tokens: tuple[int, ...]
    parent: tuple  # (block id, generation); a first block's is (NULL_BLOCK, -1, the chain's root)
    generation: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcounts = [0] * num_blocks
        self.refcounts[NULL_BLOCK] = 1
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # oldest first
        self._named: dict[bytes, int] = {}  # content name -> the block cached under it
        self._content: dict[int, Cached] = {}  # block -> what it was cached with
        self._generations = itertools.count()
        self.evictions = 0  # cached blocks handed out for new content
        self.events = None  # a kv.events.KVEventLog while someone listens to what is named and let go

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

    @property
    def num_cached(self) -> int:
        """Blocks holding named content (held or free)."""
        return len(self._content)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._content if self.refcounts[b] == 0)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks for new content: the least recently freed first, evicting any name they had."""
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.refcounts[b] = 1
            if b in self._content:
                self._uncache(b)
                self.evictions += 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Release one hold on each block; pass a sequence's blocks in order (they are queued tail first)."""
        for b in reversed(list(blocks)):
            if b == NULL_BLOCK or self.refcounts[b] <= 0:
                raise RuntimeError(f"block {b} freed while not held (refcount {self.refcounts[b]})")
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self._free[b] = None

    # ---- prefix caching -------------------------------------------------------------------------------
    def cached_run(self, names: Sequence[bytes], tokens_of, root: bytes = b"") -> list[int]:
        """The longest run of cached blocks for a sequence whose full blocks are named `names`
        (`tokens_of(i)` gives block i's token ids) and whose chain starts at `root` (a cache salt's); each hit
        is checked against its stored content."""
        hits, parent = [], (*ROOT, root)
        for i, name in enumerate(names):
            block = self._named.get(name)
            if block is None:
                break
            held = self._content[block]
            if held.parent != parent or held.tokens != tuple(tokens_of(i)):
                break
            hits.append(block)
            parent = (block, held.generation)
        return hits

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are free now (taking them shrinks the free count)."""
        return sum(1 for b in blocks if self.refcounts[b] == 0)

    def hold(self, blocks: Iterable[int]) -> None:
        """Hold matched blocks: one more holder each, off the free queue if they were on it."""
        for b in blocks:
            if self.refcounts[b] == 0:
                del self._free[b]
            self.refcounts[b] += 1

    def cache_full_block(self, block: int, name: bytes, tokens: Sequence[int], parent_block: int | None,
               root: bytes = b"") -> bool:
        """Name a block that is full (or will be once this step runs). `parent_block` is the sequence's block
        before it (None for its first). Returns True when it was named now; False when it cannot be: its name is taken by another
        block (the content is already cached), it is named already, or its parent is not itself cached."""
        if block in self._content or name in self._named:
            return False
        if parent_block is None:
            parent = (*ROOT, root)  # a first block also records the chain's root: two salts never meet
        elif parent_block in self._content:
            parent = (parent_block, self._content[parent_block].generation)
        else:
            return False
        self._content[block] = Cached(name, tuple(tokens), parent, next(self._generations))
        self._named[name] = block
        if self.events is not None:
            self.events.stored(name, None if parent_block is None else self._content[parent_block].name, tokens)
        return True

    def uncache(self, blocks: Iterable[int]) -> None:
        """Un-name blocks whose content will never be written (their step failed)."""
        for b in blocks:
            if b in self._content:
                self._uncache(b)

    def reset_cache(self) -> int:
        """Forget every name (blocks in use keep their content for their holders); returns how many."""
        n = len(self._content)
        self._named.clear()
        self._content.clear()
        if self.events is not None:
            self.events.cleared()
        return n

    def _uncache(self, block: int) -> None:
        held = self._content.pop(block)
        if self._named.get(held.name) == block:
            del self._named[held.name]
            if self.events is not None:
                self.events.removed(held.name)

    def named(self) -> set[bytes]:
        """Every name the pool holds content under (what a KV event subscriber should have rebuilt)."""
        return set(self._named)

    # ---- proof ----------------------------------------------------------------------------------------
    def audit(self, owners: Mapping[str, Iterable[int]]) -> None:
        """Prove every block is free (named or not) or held by live owners, with refcounts that add up.

        `owners` maps each live sequence to the blocks it holds (a shared block appears under each holder).
        Raises AssertionError naming the first block that is leaked, double-freed or over-counted.
        """
        held = [0] * self.num_blocks
        for owner, blocks in owners.items():
            for b in blocks:
                assert b != NULL_BLOCK, f"request {owner} holds the null block"
                held[b] += 1
        free = set(self._free)
        assert NULL_BLOCK not in free, "the null block is on the free list"
        for b in range(1, self.num_blocks):
            if b in free:
                assert held[b] == 0, f"block {b} is free but held by a live request"
                assert self.refcounts[b] == 0, f"block {b} is free with refcount {self.refcounts[b]}"
            else:
                assert held[b] > 0, f"block {b} is neither free nor held by a live request (leaked)"
                assert self.refcounts[b] == held[b], (
                    f"block {b} has refcount {self.refcounts[b]} but {held[b]} holders"
                )
        for name, b in self._named.items():
            assert self._content.get(b) is not None and self._content[b].name == name, \
                f"block {b} is named but holds no such content"
