"""KVManager: the block pool and the prefix cache behind the calls the scheduler makes.

The scheduler decides who runs; this decides where their K/V lives. It is asked to `admit` a waiting request
(its cached prefix, then blocks for its first chunk), to `reserve` blocks for more tokens of a running one, to
`free` a preempted or finished one, and, once a step has run, to `confirm` the names that step's chunks gave
their blocks, or to `rollback` them when it failed. Everything about prefix caching lives here: each request's
chain of block names (kv/prefix.py), cache salts, naming blocks as the chunks that fill them are scheduled, and
every counter. Nobody else touches the pool.

A request admitted after a chunk that fills a block, in the same step too, shares that block: within a step
every layer writes all new K/V before any attention reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nanoserve.kv.pool import BlockPool
from nanoserve.kv.prefix import BlockNames, HashFn, root_hash, sha256_block
from nanoserve.stats import KVStats, PrefixCacheStats


@dataclass(frozen=True)
class CachedPrefix:
    """What the cache holds of a request about to be admitted: leading full blocks, and the tokens they cover.
    The scheduler reads only `num_tokens`; the blocks go back to `admit`."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0


NO_PREFIX = CachedPrefix()


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False,
                 cache_identity: tuple = (), hash_fn: HashFn = sha256_block):
        """`cache_identity`: what besides the tokens decides the K/V (model, quantization, dtype), so two
        engines' names never meet; `hash_fn` names a block (tests pass a colliding one)."""
        self._pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.hash_fn = hash_fn
        self._root = root_hash(*cache_identity)
        self._names: dict[int, BlockNames] = {}  # Request.serial -> its chain of full-block names
        self._named: dict[int, int] = {}  # Request.serial -> how many of its leading blocks are named in the pool
        self._pending: list[int] = []  # blocks named for content a scheduled step has yet to write
        self._queries = self._hits = 0  # tokens looked up / found cached (vLLM's counters)

    @property
    def cache_root(self) -> bytes:
        """The parent of every unsalted chain's first block name (a salted chain's is root_hash(it, salt)): what
        a data-parallel front end needs to name a prompt's blocks as this pool does."""
        return self._root

    # ---- sizes ----------------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self._pool.num_usable

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    def blocks_for(self, num_tokens: int) -> int:
        return self._pool.blocks_for(num_tokens)

    # ---- the scheduler's calls ------------------------------------------------------------------------
    def cached_prefix(self, req) -> CachedPrefix:
        """The cached full blocks a request being admitted can take, short of its last token (always computed,
        so it gets logits). None for a request that wants its prompt's logprobs: every prompt position must
        be computed for those."""
        if not self.prefix_caching or req.prompt_logprobs is not None:
            return NO_PREFIX
        bs, root = self.block_size, self._root_of(req)
        names = self._chain(req).extend(req.tokens, (req.num_tokens - 1) // bs, bs, root, self.hash_fn)
        hits = self._pool.cached_run(names, lambda i: req.tokens(i * bs, (i + 1) * bs), root)
        return CachedPrefix(tuple(hits), len(hits) * bs)

    def admit(self, req, prefix: CachedPrefix, num_new: int) -> bool:
        """Give a waiting request its cached prefix and blocks for `num_new` tokens after it; False, with
        nothing changed, when the free blocks do not cover it (taking a free cached block uses one too)."""
        need = self.blocks_for(prefix.num_tokens + num_new) - len(prefix.blocks)
        if not self._pool.can_allocate(need + self._pool.num_free_among(prefix.blocks)):
            return False
        self._count_lookup(req, prefix.num_tokens)
        self._pool.hold(prefix.blocks)
        req.blocks = list(prefix.blocks) + self._pool.allocate(need)
        self._named[req.serial] = len(prefix.blocks)
        self._name_blocks(req, prefix.num_tokens + num_new)
        return True

    def reserve(self, req, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of a running request (past its computed ones); False, with nothing
        changed, when too few are free (the scheduler then preempts)."""
        need = self.blocks_for(req.num_computed + num_new) - len(req.blocks)
        if not self._pool.can_allocate(need):
            return False
        if need > 0:
            req.blocks.extend(self._pool.allocate(need))
        self._name_blocks(req, min(req.num_computed + num_new, req.num_tokens))  # drafted tokens are not known yet
        return True

    def free(self, req, *, finished: bool) -> None:
        """Return a request's blocks (a preempted one keeps its names: its tokens, and so they, are unchanged)."""
        if req.blocks:
            self._pool.free(req.blocks)
            req.blocks = []
        self._named.pop(req.serial, None)
        if finished:
            self._names.pop(req.serial, None)

    def confirm(self) -> None:
        """The scheduled step ran: the blocks named for it now hold that content."""
        self._pending.clear()

    def rollback(self) -> None:
        """The scheduled step failed: un-name the blocks it was to fill, whose content will never be written."""
        self._pool.uncache(self._pending)
        self._pending.clear()

    # ---- prefix caching -------------------------------------------------------------------------------
    def _chain(self, req) -> BlockNames:
        return self._names.setdefault(req.serial, BlockNames())

    def _root_of(self, req) -> bytes:
        """The root of a request's chain of names: the engine's, or one of its own under a cache salt (vLLM's
        cache_salt: requests share cached blocks only with requests that carry the same salt)."""
        return self._root if req.cache_salt is None else root_hash(self._root, req.cache_salt)

    def _count_lookup(self, req, cached: int) -> None:
        if not self.prefix_caching:
            return
        if req.prompt_logprobs is not None:  # it did not look: none of its prompt came from the cache
            req.num_cached_tokens = 0
            return
        self._queries += req.num_tokens
        self._hits += cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached

    def _name_blocks(self, req, end: int) -> None:
        """Name the full blocks of tokens [.., end), computed once the step runs."""
        if not self.prefix_caching:
            return
        bs, named = self.block_size, self._named.get(req.serial, 0)
        full = end // bs
        if full <= named:
            return
        root = self._root_of(req)
        names = self._chain(req).extend(req.tokens, full, bs, root, self.hash_fn)
        prompt_blocks = len(req.prompt_ids) // bs
        for i in range(named, full):
            block = req.blocks[i]
            parent = req.blocks[i - 1] if i else None
            if self._pool.cache_full_block(block, names[i], req.tokens(i * bs, (i + 1) * bs), parent, root):
                self._pending.append(block)
                if i < prompt_blocks:
                    req.cache_written[i] = bs
        self._named[req.serial] = full

    def record_events(self, log) -> None:
        """From now on the pool tells `log` (kv.events.KVEventLog) every name it takes in or lets go."""
        self._pool.events = log

    def named_blocks(self) -> set[bytes]:
        """The block names the pool holds now."""
        return self._pool.named()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's name (vLLM's reset_prefix_cache); returns how many were named."""
        return self._pool.reset_cache()

    # ---- observation ----------------------------------------------------------------------------------
    def stats(self, cache_bytes: int) -> tuple[KVStats, PrefixCacheStats]:
        pool = self._pool
        return (KVStats(self.block_size, pool.num_usable, pool.num_free, pool.num_used, cache_bytes),
                PrefixCacheStats(self.prefix_caching, self._queries, self._hits, pool.num_cached,
                                 pool.num_cached_free, pool.evictions))

    def audit(self, owners: Mapping[str, Iterable[int]]) -> None:
        """Assert every block is free or held by a live request (see BlockPool.audit)."""
        self._pool.audit(owners)
