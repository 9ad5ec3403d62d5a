"""Drafter: which decode rows draft this step and what, and the counters of what was drafted and kept.

Drafting pays while a step is bound by its fixed per-call cost: a few rows, each verifying a few positions,
cost little more than the rows alone. A request's draft length follows what it keeps: it starts at
FIRST_LENGTH; after a draft kept whole the next may be twice as long (up to num_speculative_tokens; never
shorter), after one that failed at token j it is j + 1, so a request copying text drafts long runs and one that
wanders probes with a token or two. It stands
down where it would not pay: a step with more than
MAX_DRAFT_ROWS decode rows (a crowd keeps the linears busy already), drafts past MAX_STEP_TOKENS in a step,
and a request whose drafts keep failing
(under MIN_ACCEPTANCE of its drafted tokens kept over its last PROBATION drafts; it tries again after
RETRY_STEPS steps). Under a grammar (structured output) a draft is cut where the grammar would refuse it, and
each verified position is masked by the grammar's state after the drafts before it.
"""

from __future__ import annotations

from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.speculative.ngram import propose
from nanoserve.speculative.suffix import SuffixProposer, SuffixSearch

MAX_DRAFT_ROWS = 8  # decode rows in a step above which no row drafts
MAX_STEP_TOKENS = 32  # drafted tokens a step verifies in all (two AMX tiles' rows)
FIRST_LENGTH = 2  # a request's first draft: it earns longer ones by keeping them
PROBATION = 8  # drafts a request is judged on
MIN_ACCEPTANCE = 0.2  # the share of its drafted tokens a request must keep to go on drafting
RETRY_STEPS = 64  # steps a request that stood down waits before it drafts again


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.max_step_tokens = MAX_STEP_TOKENS
        k = config.num_speculative_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # vLLM's num_accepted_tokens_per_pos: drafts kept at position i
        self.stood_down_steps = 0  # steps whose crowd of decode rows drafted nothing
        self.stood_down_requests = 0  # times a request's low acceptance stopped its drafting
        self.grammar_cut_tokens = 0  # drafted tokens dropped because the request's grammar would refuse them
        self._step = 0
        self._kept = 0  # drafted tokens the latest step kept, for its timing
        # decode-only steps, timed: [seconds, tokens made] of those that verified drafts and of those that did not
        self.drafting_steps, self.plain_steps = [0.0, 0], [0.0, 0]
        self.suffix = None  # the suffix method's proposer (it keeps recent outputs); None for ngram
        if config.method == "suffix":
            s = config.suffix
            self.suffix = SuffixProposer(SuffixSearch(s["suffix_decoding_max_tree_depth"],
                                                      s["suffix_decoding_max_spec_factor"],
                                                      s["suffix_decoding_min_token_prob"]),
                                         s["suffix_decoding_max_cached_requests"])

    def propose(self, req, budget: int, rows: int) -> tuple[int, ...]:
        """The drafts for decode row `req` in a step of `rows` decode rows with `budget` tokens left: at most
        num_speculative_tokens, never past the request's max_tokens; () where drafting stands down."""
        if rows > MAX_DRAFT_ROWS:
            return ()
        if req.spec_paused_until > self._step:
            return ()
        longest = min(FIRST_LENGTH, self.config.num_speculative_tokens) if req.spec_length is None else req.spec_length
        k = min(longest, budget, req.max_tokens - len(req.output_ids) - 1)
        if k <= 0:
            return ()
        drafts = self._lookup([*req.prompt_ids, *req.output_ids], k)
        if req.matcher is not None and drafts:  # under a grammar: only what it would take can be kept anyway
            valid = req.matcher.valid_prefix(drafts)
            self.grammar_cut_tokens += len(drafts) - valid
            drafts = drafts[:valid]
        return tuple(drafts)

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        if self.suffix is not None:
            return self.suffix.propose(tokens, k)
        return propose(tokens, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def finished(self, req) -> None:
        """A request ended: the suffix method keeps its output for the requests after it."""
        if self.suffix is not None and req.finish_reason != "error":
            self.suffix.finished(req.output_ids)

    def observe(self, sched, accepted: dict[int, int]) -> None:
        """Count a step's drafts and the tokens kept of each; judge each drafting request's acceptance."""
        self._step += 1
        self._kept = sum(accepted.values())
        if len(sched.decodes) > MAX_DRAFT_ROWS:
            self.stood_down_steps += 1
        for chunk in sched.decodes:
            if not chunk.drafts:
                continue
            req, kept = chunk.request, accepted.get(chunk.request.serial, 0)
            self.num_drafts += 1
            self.num_draft_tokens += len(chunk.drafts)
            self.num_accepted_tokens += kept
            for i in range(kept):
                self.accepted_per_pos[i] += 1
            req.spec_draft_tokens += len(chunk.drafts)
            req.spec_accepted_tokens += kept
            req.spec_drafts += 1
            req.spec_length = (min(self.config.num_speculative_tokens, max(req.spec_length or 0, 2 * kept))
                               if kept == len(chunk.drafts) else kept + 1)
            self._judge(req)

    def timed(self, sched, seconds: float) -> None:
        """A step's time: a decode-only step's seconds and tokens go to the drafting or the plain total, so the
        speed of the steps that verified drafts is measured against that of the ones that did not."""
        if sched.prefills or not sched.decodes:
            return
        totals = self.drafting_steps if sched.draft_tokens else self.plain_steps
        totals[0] += seconds
        totals[1] += len(sched.decodes) + (self._kept if sched.draft_tokens else 0)

    def _judge(self, req) -> None:
        """Every PROBATION drafts, a request that kept under MIN_ACCEPTANCE of the tokens they drafted pauses."""
        if req.spec_drafts % PROBATION:
            return
        drafted = req.spec_draft_tokens - req.spec_judged_from[0]
        kept = req.spec_accepted_tokens - req.spec_judged_from[1]
        if kept < MIN_ACCEPTANCE * drafted:
            req.spec_paused_until = self._step + RETRY_STEPS
            self.stood_down_requests += 1
        req.spec_judged_from = (req.spec_draft_tokens, req.spec_accepted_tokens)

    def as_dict(self) -> dict:
        """The stats snapshot's `speculative` section, under vLLM's counter names."""
        drafted = self.num_draft_tokens
        return {"method": self.config.method, "num_speculative_tokens": self.config.num_speculative_tokens,
                "num_drafts": self.num_drafts, "num_draft_tokens": drafted,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": round(self.num_accepted_tokens / drafted, 4) if drafted else None,
                "mean_acceptance_length": (round(1 + self.num_accepted_tokens / self.num_drafts, 3)
                                           if self.num_drafts else None),
                "stood_down_steps": self.stood_down_steps, "stood_down_requests": self.stood_down_requests,
                "grammar_cut_tokens": self.grammar_cut_tokens,
                "drafting_steps_s": round(self.drafting_steps[0], 6), "drafting_steps_tokens": self.drafting_steps[1],
                "plain_steps_s": round(self.plain_steps[0], 6), "plain_steps_tokens": self.plain_steps[1],
                **({"cached_requests": len(self.suffix.cache)} if self.suffix is not None else {})}
