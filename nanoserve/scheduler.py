"""Scheduler: which requests run this step, and how many of their tokens.

Policy (decode first, then chunked prefill):
1. Every running request with one token left to compute (a decode row) gets it, before anything else.
   If its next token needs a block and none is free, the most recently admitted running request is
   preempted by recompute (its blocks freed, back to the front of the queue, its tokens kept).
2. Running requests part-way through a long prompt continue with chunks from what budget remains.
3. Waiting requests are admitted in arrival order while rows, budget and free blocks allow; admission never
   preempts, and nothing is admitted in a step that had to preempt.
So a burst of new prompts can slow decodes (they share the step) but never stop them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.kv.pool import BlockPool
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

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first to be preempted
        self.peak_running = 0
        self.num_preemptions = 0

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
                scheduled.add(id(req))
                budget -= n
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not self.pool.can_allocate(self.pool.blocks_for(n)):
                break
            self.waiting.popleft()
            req.blocks = self.pool.allocate(self.pool.blocks_for(n))
            req.status = Status.RUNNING
            self.running.append(req)
            out.prefills.append(Chunk(req, req.num_computed, n))
            budget -= n
        self.peak_running = max(self.peak_running, len(self.running))
        return out

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
        req.num_computed = 0
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
