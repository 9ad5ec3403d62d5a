"""StepBatch: everything a forward needs to know about where this step's tokens live.

The model's input contract. The model runner builds it (nanoserve/runner/batch.py, runner/decode/) before the
forward and it is handed to every attention layer, so addressing is planned once per step instead of being
threaded through (or recomputed in) each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """A run of consecutive tokens of one sequence: tokens [start, start+length) of the flat batch,
    which are positions [context_start, context_start+length) of the sequence."""

    start: int
    length: int
    context_start: int  # > 0: the segment continues a sequence whose past it reads from the cache


@dataclass(frozen=True)
class StepBatch:
    """Flat token layout: the first `num_decode` tokens are single-token rows read through PagedRead;
    the rest are prefill segments attended with causal attention."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    slots: torch.Tensor  # [tokens] cache slot each token's K/V is written to
    num_decode: int
    decode_block_table: torch.Tensor  # [num_decode, width]
    decode_context_lens: torch.Tensor  # [num_decode]
    prefills: tuple[PrefillSegment, ...]
    logits_indices: torch.Tensor  # [sampled rows] which tokens' hidden states become logits
    prefill_tables: tuple[tuple[int, ...], ...] = ()  # each segment's sequence's cache blocks up to its end (host
    # ints: each attention path builds its own device tables from them, nanoserve/attention/step.py)
