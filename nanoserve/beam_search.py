"""Beam search as vLLM's server runs it: each step asks the engine for one token of every live beam with the top
2 x width logprobs (the prefix cache serves the beams' shared prompt), extends each beam by its candidates, and
keeps the `beam_width` best by cumulative logprob; a beam that picks an end token is finished. The finished and
the live beams are ranked by cumulative logprob over generated length ** length_penalty (Transformers' rule) and
the best `beam_width` returned.

The search is a function of the engine's logprobs alone (`Step`), so it is deterministic: ties keep the order
the candidates were met in (beam order, then the engine's rank order).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from nanoserve.errors import RequestError
from nanoserve.sampler import TokenLogprobs

# the next position's logprobs for each token sequence (prompt and generated so far), with at least the top
# `alternatives` in `top` (or exactly the ids asked, when the search is limited to allowed ids)
Step = Callable[[list[list[int]], int, Sequence[int] | None], Awaitable[list[TokenLogprobs]]]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams kept, at most `max_tokens` tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # beams are ranked by raw logprobs: any other temperature would change nothing
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a finished beam keeps its end token
    skip_special_tokens: bool = True  # for the beams' text
    allowed_token_ids: tuple[int, ...] | None = None  # only these extend a beam (at most 128: they are scored)

    def __post_init__(self):
        if self.beam_width < 1:
            raise RequestError(f"a beam search keeps at least one beam, not {self.beam_width}")
        if self.max_tokens < 1:
            raise RequestError(f"a beam search generates at least one token, not {self.max_tokens}")
        if self.temperature != 0:
            raise RequestError(f"temperature {self.temperature} would change nothing: beams are ranked by the "
                               "model's raw logprobs; leave it at 0")


@dataclass
class Beam:
    tokens: list[int]  # generated, with the end token only when include_stop_str_in_output
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per step, the end token's included
    finish_reason: str = "length"
    stop_reason: int | None = None

    def score(self, length_penalty: float) -> float:
        """Cumulative logprob over generated length ** length_penalty (an end token counts)."""
        return self.cum_logprob / (max(len(self.logprobs), 1) ** length_penalty)


async def beam_search(step: Step, prompt: list[int], params: BeamSearchParams, end_ids: set[int]) -> list[Beam]:
    """The `beam_width` best beams continuing `prompt`, best first."""
    live, finished = [Beam([])], []
    for _ in range(params.max_tokens):
        entries = await step([prompt + b.tokens for b in live], 2 * params.beam_width, params.allowed_token_ids)
        candidates = []
        for beam, entry in zip(live, entries, strict=True):
            for token, logprob in _choices(entry, params.allowed_token_ids):
                total = beam.cum_logprob + logprob
                if token in end_ids and not params.ignore_eos:
                    kept = beam.tokens + [token] if params.include_stop_str_in_output else beam.tokens
                    finished.append(Beam(kept, total, beam.logprobs + [entry], "stop", token))
                else:
                    candidates.append((total, token, beam, entry))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the order they were met in
        live = [Beam(b.tokens + [t], total, b.logprobs + [e]) for total, t, b, e in candidates[:params.beam_width]]
        if not live:
            break
    ranked = sorted(finished + live, key=lambda b: -b.score(params.length_penalty))
    return ranked[:params.beam_width]


def _choices(entry: TokenLogprobs, allowed: Sequence[int] | None) -> list[tuple[int, float]]:
    """The tokens a beam may continue with: its top alternatives (or the allowed ids), finite ones only."""
    options = [(t, lp) for t, lp in entry.top if allowed is None or t in allowed]
    return [(t, lp) for t, lp in options if lp > float("-inf")]


@dataclass
class BeamSearchSequence:
    """vLLM's offline result: the prompt's tokens and the beam's, their text, and how the beam ended."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float
    text: str
    finish_reason: str
    stop_reason: int | None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
