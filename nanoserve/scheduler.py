"""Scheduler: which requests run this step and how many of their tokens, and applying what the step produced.

Policy (decode first, then chunked prefill):
1. Every running request with one token left to compute (a decode row) gets it, before anything else.
   If its next token needs a block and none is free, the most recently admitted running request is
   preempted by recompute (its blocks freed, back to the front of the queue, its tokens kept).
2. Running requests part-way through a long prompt continue with chunks from what budget remains.
3. Waiting requests are admitted in arrival order while rows, budget and free blocks allow; admission never
   preempts, and nothing is admitted in a step that had to preempt.
So a burst of new prompts can slow decodes (they share the step) but never stop them. While decode rows run,
the prefill share of a step is also cut to what fits in a target step time (step_budget.py) when one of them is
streamed, so a long prompt arriving beside a stream is read over several steps instead of freezing it for one.

Where the K/V lives is the KV manager's (kv/manager.py): the scheduler asks it to admit, reserve and free, and
with prefix caching an admitted request (new, or back from preemption) computes only what the cache does not
hold, always at least its last token, so it gets logits.

After the step, `update_from_output` advances each chunk's computed count, appends the sampled tokens, and
retires a sequence that ended on a token (EOS, a stop token id: both once min_tokens exist) or at max_tokens.
A stop string is found in the text, by the output processor, which asks for that sequence to be finished.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.kv.manager import KVManager
from nanoserve.request import Request, Status
from nanoserve.stats import SchedulerStats
from nanoserve.step_budget import StepBudget


@dataclass(frozen=True)
class Chunk:
    """Compute tokens [start, start+length) of `request` this step; a decode chunk may carry `drafts`, tokens
    guessed to follow it, whose positions the step computes too and its sampling verifies (speculative/)."""

    request: Request
    start: int
    length: int
    drafts: tuple[int, ...] = ()

    @property
    def completes(self) -> bool:
        """True when this chunk computes the request's last token, so the step samples its next one."""
        return self.start + self.length == self.request.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cut_by_time: bool = False  # the step-time budget cut a prefill chunk short (step_budget.py)

    @property
    def streamed_decodes(self) -> int:
        """Decode rows someone sees token by token: the rows a slow step keeps waiting."""
        return sum(1 for c in self.decodes if c.request.streamed)

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.draft_tokens + sum(c.length for c in self.prefills)

    @property
    def draft_tokens(self) -> int:
        return sum(len(c.drafts) for c in self.decodes)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefills)

    @property
    def request_ids(self) -> set[str]:
        return {c.request.request_id for c in (*self.decodes, *self.prefills)}


def stop_token(req: Request, token: int) -> tuple[bool, int | None]:
    """Whether `token` ends the sequence (a stop token id, or EOS unless ignore_eos), once min_tokens exist; and
    the stop reason (the id for a stop token id, None for EOS)."""
    params = req.params
    if len(req.output_ids) < params.min_tokens:
        return False, None
    if token in params.stop_token_ids:
        return True, token
    return (not params.ignore_eos and token in req.eos_token_ids), None


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 step_budget: StepBudget | None = None, drafter=None, on_finish=None):
        self.kv = kv
        self.drafter = drafter  # speculative.Drafter: a decode row's drafted tokens, or None (off)
        self.on_finish = on_finish  # called with each request finish() retires (the engine's bookkeeping)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = step_budget or StepBudget(0, kv.block_size)  # 0: off, the token budget alone
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first to be preempted
        self.peak_running = 0
        self.num_preemptions = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.faulted: list[Request] = []  # sequences whose own grammar failed on a token: the engine ends them

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()  # id() of the requests given a chunk so far this step (never preempted)
        for req in [r for r in self.running if r.num_uncomputed == 1]:
            if req.status is Status.RUNNING and self._reserve(req, 1, out, scheduled):
                out.decodes.append(Chunk(req, req.num_computed, 1))
                scheduled.add(id(req))
                budget -= 1
        if self.drafter is not None:
            budget -= self._draft(out, budget)
        timed = self.step_budget.prefill_limit(out.streamed_decodes, budget, len(out.decodes))  # what fits in time
        cut, budget = timed < budget, timed
        for req in [r for r in self.running if r.num_uncomputed > 1]:
            if budget <= 0:
                break
            n = self._chunk(req, req.num_computed, budget, cut, out)
            if req.status is Status.RUNNING and self._reserve(req, n, out, scheduled):
                out.prefills.append(Chunk(req, req.num_computed, n))
                scheduled.add(id(req))
                budget -= n
        self._admit(out, budget, cut)
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _draft(self, out: SchedulerOutput, budget: int) -> int:
        """Give decode rows the drafts the drafter proposes, while the token budget lasts and free blocks hold
        them (a draft never preempts anyone); returns the tokens they take."""
        taken, budget = 0, min(budget, self.drafter.max_step_tokens)
        for i, chunk in enumerate(out.decodes):
            drafts = self.drafter.propose(chunk.request, budget - taken, len(out.decodes))
            if drafts and self.kv.reserve(chunk.request, 1 + len(drafts)):
                out.decodes[i] = Chunk(chunk.request, chunk.start, 1, drafts)
                taken += len(drafts)
        return taken

    def _chunk(self, req: Request, start: int, budget: int, cut: bool, out: SchedulerOutput) -> int:
        """Tokens of `req` from `start` this step: all that remain if the budget allows; a chunk the step-time
        budget cut ends on a block boundary where one lies inside it."""
        remaining = req.num_tokens - start
        n = min(remaining, budget)
        if cut and n < remaining:
            out.cut_by_time = True
            n = self.step_budget.cut(start, n)
        return n

    def _admit(self, out: SchedulerOutput, budget: int, cut: bool = False) -> None:
        """Waiting requests in arrival order, each with what the prefix cache holds of it, while rows, budget and
        blocks allow; none in a step that had to preempt."""
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.cached_prefix(req)
            n = self._chunk(req, cached.num_tokens, budget, cut, out)
            if not self.kv.admit(req, cached, n):
                break
            self.waiting.popleft()
            req.num_computed = cached.num_tokens
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.prefills.append(Chunk(req, cached.num_tokens, n))
            budget -= n

    def _reserve(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Make sure `req` holds blocks for n more tokens, preempting the newest rows not yet scheduled.

        `scheduled` is kept by the caller as chunks are handed out: rebuilding it here for every row made a
        step's scheduling cost grow with rows squared. Returns False when `req` itself had to be preempted.
        """
        while not self.kv.reserve(req, n):
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled), req)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req, finished=False)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- applying a step ------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result) -> None:
        """The step ran: its chunks' K/V are in the cache, and each sampled row gets its token (a StepResult)."""
        self.kv.confirm()
        accepted = getattr(result, "accepted", {})
        for chunk in (*out.decodes, *out.prefills):
            req = chunk.request
            req.num_computed += chunk.length + accepted.get(req.serial, 0)  # drafts the step kept are computed
            if not req.output_ids and chunk.completes:  # a prompt's first completion
                self.prompt_tokens += len(req.prompt_ids)
        self.append(result)

    def append(self, result) -> None:
        """Each sampled row's token onto its request (one token a request: a speculative step's later tokens
        come as later results, so a request that ends on one never gets the next)."""
        for req, token in zip(result.sampled, result.token_ids):
            self._append(req, token)

    def _append(self, req: Request, token: int) -> None:
        if req.matcher is not None and not req.matcher.consume(token):
            self.faulted.append(req)  # the token is not kept: nothing after the failure is said to be the answer
            return
        req.output_ids.append(token)
        self.generation_tokens += 1
        stopped, req.stop_reason = stop_token(req, token)
        if stopped:
            self.finish(req, "stop")
        elif len(req.output_ids) >= req.max_tokens:
            self.finish(req, "length")

    def fail(self, requests: list[Request]) -> None:
        """The scheduled step failed: the names its chunks gave blocks are forgotten (that content was never
        written) and `requests` (every sequence of the requests it carried) end with finish reason "error"."""
        self.kv.rollback()
        for req in requests:
            if not req.finished:
                self.finish(req, "error")

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request wherever it is, returning its blocks to the pool at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req, finished=True)
        req.status = Status.FINISHED
        req.finish_reason = reason
        if self.on_finish is not None:
            self.on_finish(req)

    # ---- observation ----------------------------------------------------------------------------------
    def stats(self, finished: dict, steps: int) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), peak_running=self.peak_running,
            preemptions=self.num_preemptions, finished=finished, prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens, steps=steps,
        )

    def live(self) -> tuple[Request, ...]:
        """Every unfinished sequence, running first."""
        return (*self.running, *self.waiting)

    def owners(self) -> dict[str, list[int]]:
        """Live sequence name -> blocks held, for the KV manager's audit."""
        return {r.name: r.blocks for r in self.live() if r.blocks}
