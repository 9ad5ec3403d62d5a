"""StepBatch: everything a forward needs to know about where this step's tokens live.

Built by the engine before the forward and handed to every attention layer, so addressing is planned
once per step instead of being threaded through (or recomputed in) each layer.
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
    context_start: int
    block_table: torch.Tensor  # [blocks] covering context_start + length tokens


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


def decode_rows(requests: list, positions: list[int], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """One decode token per request at `positions`: its input token, the KV slot it writes, and the context
    length it attends over (everything up to and including itself). Shared by the general and fast builders."""
    ids = [r.tokens(p, p + 1)[0] for r, p in zip(requests, positions)]
    slots = [r.blocks[p // block_size] * block_size + p % block_size for r, p in zip(requests, positions)]
    return ids, slots, [p + 1 for p in positions]
