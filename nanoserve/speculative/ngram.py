"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the longest n in [min_n, max_n] that occurs. Costs no model: on copy-heavy work (edit this text,
quote this document, rename in this code) the continuation is often already in the prompt or the answer."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k drafted next tokens for a sequence `tokens` (prompt and output so far); [] when no suffix of
    min_n..max_n tokens occurred before."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = seq.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # every n-gram that ends before the last
        hits = np.flatnonzero((windows == seq[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the nearest context is the likeliest to repeat
            return seq[start:start + k].tolist()
    return []
