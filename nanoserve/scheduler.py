"""Scheduler: which requests run this step, and how many of their tokens.

Policy (decode first, then chunked prefill):
1. Every running request with one token left to compute (a decode row) gets it, before anything else.
   If its next token needs a block and none is free, the most recently admitted running request is
   preempted by recompute (its blocks freed, back to the front of the queue, its tokens kept).
2. Running requests part-way through a long prompt continue with chunks from what budget remains.
3. Waiting requests are admitted in arrival order while rows, budget and free blocks allow; admission never
   preempts, and nothing is admitted in a step that had to preempt.
So a burst of new prompts can slow decodes (they share the step) but never stop them.

With prefix caching, an admitted request (new, or back from preemption) first takes the longest run of
cached full blocks of its tokens and computes only the rest, always at least its last token, so it gets
logits. Each chunk names the blocks it fills as it is scheduled (BlockPool.commit), so a request admitted
after it, in the same step too, shares them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.kv.pool import BlockPool
from nanoserve.kv.prefix import HashFn, root_hash, sha256_block
from nanoserve.request import Request, Status


@dataclass(frozen=True)
class Chunk:
    """Compute tokens [start, start+length) of `request` this step."""

    request: Request
    start: int
    length: int

    @property
    def completes(self) -> bool:
        """True when this chunk computes the request's last token, so the step samples its next one."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # blocks named this step (forgotten if it fails)

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False, cache_identity: tuple = (), hash_fn: HashFn = sha256_block):
        """`cache_identity`: what besides the tokens decides the K/V (model, quantization, dtype), so two
        engines' names never meet; `hash_fn` names a block (tests pass a colliding one)."""
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first to be preempted
        self.peak_running = 0
        self.num_preemptions = 0
        self.prefix_caching, self.hash_fn = prefix_caching, hash_fn
        self.root = root_hash(*cache_identity)
        self.prefix_queries = self.prefix_hits = 0  # tokens looked up / found cached (vLLM's counters)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()  # id() of the requests given a chunk so far this step (never preempted)
        for req in [r for r in self.running if r.num_uncomputed == 1]:
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if not self._reserve(req, 1, out, scheduled):
                continue
            out.decodes.append(Chunk(req, req.num_computed, 1))
            self._commit(req, req.num_computed + 1, out)
            scheduled.add(id(req))
            budget -= 1
        for req in [r for r in self.running if r.num_uncomputed > 1]:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue
            n = min(req.num_uncomputed, budget)
            if self._reserve(req, n, out, scheduled):
                out.prefills.append(Chunk(req, req.num_computed, n))
                self._commit(req, req.num_computed + n, out)
                scheduled.add(id(req))
                budget -= n
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._cached_prefix(req)
            cached = len(hits) * self.pool.block_size
            n = min(req.num_tokens - cached, budget)
            need = self.pool.blocks_for(cached + n) - len(hits)
            if not self.pool.can_allocate(need + self.pool.reviving(hits)):
                break
            self.waiting.popleft()
            self._count_lookup(req, cached)
            self.pool.take(hits)
            req.blocks = hits + self.pool.allocate(need)
            req.num_computed, req.committed = cached, len(hits)
            req.status = Status.RUNNING
            self.running.append(req)
            out.prefills.append(Chunk(req, cached, n))
            self._commit(req, cached + n, out)
            budget -= n
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    # ---- prefix caching -------------------------------------------------------------------------------
    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks a request being admitted can take: full blocks of its tokens, short of its last
        token (which is always computed). None for a request that wants its prompt's logprobs: those need
        every prompt position computed."""
        if not self.prefix_caching or req.prompt_logprobs is not None:
            return []
        bs = self.pool.block_size
        root = self._root(req)
        names = req.names.extend(req.tokens, (req.num_tokens - 1) // bs, bs, root, self.hash_fn)
        return self.pool.match(names, lambda i: req.tokens(i * bs, (i + 1) * bs), root)

    def _root(self, req: Request) -> bytes:
        """The root of a request's chain of names: the engine's, or one of its own under a cache salt (vLLM's
        cache_salt: requests share cached blocks only with requests that carry the same salt)."""
        return self.root if req.cache_salt is None else root_hash(self.root, req.cache_salt)

    def _count_lookup(self, req: Request, cached: int) -> None:
        if not self.prefix_caching:
            return
        if req.prompt_logprobs is not None:  # it did not look: none of its prompt came from the cache
            req.num_cached_tokens = 0
            return
        self.prefix_queries += req.num_tokens
        self.prefix_hits += cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached

    def _commit(self, req: Request, end: int, out: SchedulerOutput) -> None:
        """Name the blocks this chunk fills (tokens [.., end) computed once the step runs)."""
        if not self.prefix_caching:
            return
        bs = self.pool.block_size
        full = end // bs
        if full <= req.committed:
            return
        root = self._root(req)
        names = req.names.extend(req.tokens, full, bs, root, self.hash_fn)
        for i in range(req.committed, full):
            block = req.blocks[i]
            if self.pool.commit(block, names[i], req.tokens(i * bs, (i + 1) * bs), req.blocks[i - 1] if i else None,
                                root):
                out.committed.append(block)
        req.committed = full

    def _reserve(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Make sure `req` holds blocks for n more tokens, preempting the newest rows not yet scheduled.

        `scheduled` is kept by the caller as chunks are handed out: rebuilding it here for every row made a
        step's scheduling cost grow with rows squared. Returns False when `req` itself had to be preempted.
        """
        need = self.pool.blocks_for(req.num_computed + n) - len(req.blocks)
        while not self.pool.can_allocate(need):
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled), req)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = req.committed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request wherever it is, returning its blocks to the pool at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if req.blocks:
            self.pool.free(req.blocks)
            req.blocks = []
        req.status = Status.FINISHED
        req.finish_reason = reason

    def owners(self) -> dict[str, list[int]]:
        """Live sequence name -> blocks held, for BlockPool.audit()."""
        return {r.name: r.blocks for r in (*self.running, *self.waiting) if r.blocks}
