"""The gathered read: copy each row's blocks into one [rows, width] rectangle and attend over it.

Simple and fast on small contexts; its cost is the rectangle, which grows with the longest row.
"""

from __future__ import annotations

import torch

from nanoserve.attention.sdpa import sdpa


def gathered_mask(block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which of each row's `width * block_size` gathered positions it attends to, as SDPA's [rows, 1, 1, span]
    mask: the same for every layer of a step, so a step builds it once (see StepRead)."""
    span = block_table.shape[1] * block_size
    within = torch.arange(span, device=block_table.device)[None, :] < context_lens[:, None]
    return within[:, None, None, :]


def gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row against that row's cached context.

    q: [rows, heads, head_dim]; k_cache/v_cache: [blocks, block_size, kv_heads, head_dim] (one layer);
    block_table: [rows, width] block ids (unused entries may be anything valid, e.g. the null block);
    context_lens: [rows] tokens each row attends to; `mask`: gathered_mask of the two, when the caller has it.
    Returns [rows, heads, head_dim].
    """
    rows, width = block_table.shape
    _, block_size, kv_heads, dim = k_cache.shape
    if mask is None:
        mask = gathered_mask(block_table, context_lens, block_size)
    # one index_select over the flattened table ([rows * width] blocks), then a [rows, kv_heads, span, dim] view:
    # no copy beyond the gather itself
    ids = block_table.reshape(-1)
    k = k_cache.index_select(0, ids).view(rows, width * block_size, kv_heads, dim).transpose(1, 2)
    v = v_cache.index_select(0, ids).view(rows, width * block_size, kv_heads, dim).transpose(1, 2)
    out = sdpa(q.unsqueeze(2), k, v, mask=mask, scale=scale)
    return out.squeeze(2)
