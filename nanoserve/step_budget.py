"""StepBudget: how many prefill tokens a step may take beside running streams, sized by time rather than tokens.

A token budget sized for a GPU is the wrong unit on a CPU: there a 2,048-token prefill step takes seconds, and
every stream decoding beside it waits that long for its next token. So while a streamed request is decoding (one
whose client sees tokens as they come; a request answered at its end wants throughput), a step's prefill share
is cut to what fits in a target time, from two costs measured online over the steps the engine already times:
- a decode-only step's seconds (the median of the latest DECODE_WINDOW: one slow step, a page fault or another
  process's burst, must not loosen the target for the next dozen);
- the seconds each prefill token adds to a step that also decodes (the step's time past the decode estimate,
  over its prefill tokens). Until such a step has run, a prefill-only step's time past the decode estimate per
  token stands in, and before any prefill at all, FIRST_CHUNK tokens.

With no stream decoding, prefill takes the whole token budget as before, so an idle server's time to first token
and an offline batch's throughput do not change. The target is `--max-step-ms` (at most MOST_MS), or, unset,
DECODE_MULTIPLE decode steps (at least FLOOR_S); 0 turns the budget off. Chunk boundaries chosen this way change
no output: the batch-invariant path computes a chunked prompt bitwise as it computes it whole.

Where they cost nothing, cuts fall on the units the work comes in. Where the linears run on a tile unit (AMX,
16 rows a tile, the last padded), a step's rows fill whole tiles: one decode row beside 15 prefill tokens costs
a tile, beside 16 it costs two. A long chunk ends on a KV block boundary, which drops under an eighth of it; a
short one keeps its length, since a block is named in the prefix cache at the end of the step that fills it
wherever the chunk ended.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

DECODE_MULTIPLE = 4.0  # the auto target: a stream's gap grows at most this many decode steps while prompts are read
FLOOR_S = 0.025  # ... and at least this (a decode step timed unusually fast must not make chunks tiny)
MOST_MS = 60_000  # the longest --max-step-ms: a longer step is no budget at all (use 0), and past ~1e305 the
# target's seconds, and the stats that publish it, overflow to inf
ALPHA = 0.25  # weight of the newest step in the prefill cost's exponential average (the cost grows with context)
DECODE_WINDOW = 32  # latest decode-only steps whose median is the decode step
FIRST_CHUNK = 32  # prefill tokens beside decode rows before any prefill has been timed
AIM = 0.9  # the share of the target a step's estimate is sized to (the estimates lag a growing context)
ALIGN_FROM = 8  # blocks in a cut chunk from which it ends on a block boundary (dropping under an eighth of it)
KEPT = 8  # latest over-budget steps published


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class StepBudget:
    """The prefill share of each step while streams decode; `observe` feeds it every step's timing."""

    def __init__(self, max_step_ms: float | None, block_size: int, row_quantum: int = 1):
        self.max_step_ms = max_step_ms
        self.block_size = block_size
        self.row_quantum = row_quantum  # rows the linears compute as one unit (a tile's height, else 1)
        self.decode_s: float | None = None  # a decode-only step, seconds
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)
        self.mixed_token_s: float | None = None  # a prefill token beside decode rows, seconds
        self.prefill_token_s: float | None = None  # a prefill token in a prefill-only step, seconds
        self.limit: int | None = None  # the prefill tokens the last step beside decode rows was allowed
        self.limited_steps = 0  # steps whose prefill the budget cut short
        self.steps_over = 0  # steps with decode rows that ran past the target
        self.latest_over: deque[dict] = deque(maxlen=KEPT)

    @property
    def enabled(self) -> bool:
        return self.max_step_ms != 0

    def target_s(self) -> float:
        """The step time aimed at while decode rows run."""
        if self.max_step_ms:
            return self.max_step_ms / 1000
        return max(FLOOR_S, DECODE_MULTIPLE * (self.decode_s or 0.0))

    def token_s(self) -> float | None:
        """Seconds a prefill token adds beside decode rows: measured there, else in a prefill-only step."""
        return self.mixed_token_s if self.mixed_token_s is not None else self.prefill_token_s

    def prefill_limit(self, streams: int, tokens_left: int, decode_rows: int | None = None) -> int:
        """Prefill tokens a step with `streams` streamed decode rows (`decode_rows` in all; as many when not
        said) may take, out of the `tokens_left` its token budget leaves: all of them with no stream waiting or
        the budget off; else what fits in the target, in whole row units beside the decode rows, and at least
        one block (or the rest of the first unit), so a long prompt always advances."""
        if not self.enabled or streams == 0:
            return tokens_left
        per_token = self.token_s()
        if per_token is None:
            fits = FIRST_CHUNK
        else:
            spare = AIM * self.target_s() - (self.decode_s or 0.0)
            fits = int(spare / per_token) if per_token > 0 else tokens_left
        self.limit = min(tokens_left, self._whole_units(streams if decode_rows is None else decode_rows, fits))
        return self.limit

    def _whole_units(self, rows: int, fits: int) -> int:
        """At most `fits` prefill tokens that with `rows` decode rows fill whole row units (never fewer than the
        first unit's rest); with no unit, at least a block."""
        unit = self.row_quantum
        if unit <= 1:
            return max(self.block_size, fits)
        return max(unit - rows % unit, (rows + fits) // unit * unit - rows)

    def cut(self, start: int, length: int) -> int:
        """A chunk the time limit cut short (`length` tokens from `start`): a long one ends on a block boundary
        inside it, so the prefix cache names every block it filled; a short one keeps its length (aligning it
        would drop a large share of it, and fill a tile short)."""
        if length < ALIGN_FROM * self.block_size:
            return length
        end = start + length
        return end - end % self.block_size - start

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float, cut: bool = False,
                prefill_requests: tuple[str, ...] = (), streams: int | None = None) -> bool:
        """Learn from one step; True when a stream waited on it (`streams` of its decode rows are streamed; all
        of them when not said) and it ran past the target (kept, with the prompts whose prefill it carried)."""
        if cut:
            self.limited_steps += 1
        if decode_rows and not prefill_tokens:
            self._decode_steps.append(seconds)
            self.decode_s = statistics.median(self._decode_steps)
        elif prefill_tokens and not decode_rows:  # a step's fixed cost is about a decode step's: not the tokens'
            self.prefill_token_s = _average(self.prefill_token_s,
                                            max(0.0, seconds - (self.decode_s or 0.0)) / prefill_tokens)
        elif prefill_tokens and self.decode_s is not None:
            self.mixed_token_s = _average(self.mixed_token_s, max(0.0, seconds - self.decode_s) / prefill_tokens)
        over = bool(decode_rows if streams is None else streams) and self.enabled and seconds > self.target_s()
        if over:
            self.steps_over += 1
            self.latest_over.append({"at": time.strftime("%H:%M:%S"), "step_ms": round(1000 * seconds, 1),
                                     "target_ms": round(1000 * self.target_s(), 1), "decode_rows": decode_rows,
                                     "prefill_tokens": prefill_tokens, "prefill_requests": list(prefill_requests)})
        return over

    def as_dict(self) -> dict:
        """The stats snapshot's `step_budget` section (and, its numbers, /metrics gauges)."""
        mode = "off" if not self.enabled else ("flag" if self.max_step_ms else "auto")
        return {"enabled": self.enabled, "mode": mode, "row_quantum": self.row_quantum,
                "target_ms": _ms(self.target_s()), "decode_step_ms": _ms(self.decode_s),
                "prefill_token_ms": _ms(self.token_s()), "prefill_limit_tokens": self.limit,
                "limited_steps": self.limited_steps, "steps_over_target": self.steps_over,
                "latest_over": list(self.latest_over)}
