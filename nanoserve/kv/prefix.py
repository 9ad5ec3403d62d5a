"""Content names for full KV blocks: a chain of SHA-256 hashes, so equal prefixes find each other's blocks.

Block i of a sequence is named by hash(name of block i-1, its token ids); the first block's parent is a root
that names everything else that changes the K/V (the model, its weights' quantization, the dtype). SHA-256,
as vLLM moved to: with a predictable hash, one tenant could craft a prompt that collides with another's
cached blocks. The name is only an index: the pool also compares a hit's stored tokens and parent, so even a
collision (a stub hash in the tests) never reuses a block whose content differs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[bytes, Sequence[int]], BlockHash]


def sha256_block(parent: bytes, tokens: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_hash(*identity: object) -> BlockHash:
    """The parent of every sequence's first block: what besides the tokens decides the K/V."""
    return hashlib.sha256(repr(identity).encode()).digest()


class BlockNames:
    """A sequence's chain of full-block names, extended as its tokens are computed (kept on the Request)."""

    __slots__ = ("hashes",)

    def __init__(self):
        self.hashes: list[BlockHash] = []

    def extend(self, tokens_of: Callable[[int, int], list[int]], full_blocks: int, block_size: int,
               root: BlockHash, hash_fn: HashFn) -> list[BlockHash]:
        """The names of the first `full_blocks` blocks (computing the ones not named yet)."""
        while len(self.hashes) < full_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if i else root
            self.hashes.append(hash_fn(parent, tokens_of(i * block_size, (i + 1) * block_size)))
        return self.hashes[:full_blocks]
