"""What the determinism tests compare: each request's tokens and chosen-token logprobs, run together or alone.
Kept apart from tests/test_determinism.py (which needs hypothesis) so the gpu tests import it on a bare image."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    """(token ids, chosen-token logprobs) of each request, run together in one generate call."""
    outs = llm.generate([ids for ids, _ in requests], [p for _, p in requests], use_tqdm=False)
    return [answer(o) for o in outs]


def answer(output) -> tuple:
    c = output.outputs[0]
    return tuple(c.token_ids), tuple(entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids))


def alone(llm: LLM, requests) -> list[tuple]:
    return [run(llm, [r])[0] for r in requests]


def params(greedy: bool, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 0.9, seed=None if greedy else seed,
                          logprobs=1, ignore_eos=True)
