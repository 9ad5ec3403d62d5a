"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the longest n in [min_n, max_n] that occurs. Costs no model: on copy-heavy work (edit this text,
quote this document, rename in this code) the continuation is often already in the prompt or the answer."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k drafted next tokens for a sequence `tokens` (prompt and output so far); [] when no suffix of
    min_n..max_n tokens occurred before.

    The earlier places the last token occurs are found in one vectorised pass, then narrowed to those where the
    token before matches too, and so on: in text that does not repeat, the first pass already leaves none. A copy
    that reaches the end of the sequence continues from its own drafts, as a repeating pattern would."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = seq.shape[0]
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier n-gram equal to the suffix ends, n = 1
    best = None
    for n in range(1, min(max_n, size - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[seq[ends - (n - 1)] == seq[size - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = int(ends[-1])  # the latest occurrence of the longest suffix found: the nearest context
    if best is None:
        return []
    drafts = seq[best + 1:best + 1 + k].tolist()
    while len(drafts) < k:  # the copy runs into the suffix itself: it goes on with what it drafted (a repeat)
        drafts.append(drafts[len(drafts) - (size - best - 1)])
    return drafts
