"""Oracles shared by tests that compare two numerics of one model."""

from __future__ import annotations


def logprobs_close(a, b, k: int = 5) -> tuple[bool, int]:
    """vLLM's check_logprobs_close for one pair of completions; returns (ok, tokens equal before divergence)."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            top_a = sorted(a.logprobs[i].items(), key=lambda kv: kv[1].rank)[:k]
            top_b = sorted(b.logprobs[i].items(), key=lambda kv: kv[1].rank)[:k]
            return tb in dict(top_a) and ta in dict(top_b), i
    return True, len(a.token_ids)
