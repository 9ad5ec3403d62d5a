"""The gathered read: copy each row's blocks into one [rows, width] rectangle and attend over it.

Simple and fast on small contexts; its cost is the rectangle, which grows with the longest row.
"""

from __future__ import annotations

import torch

from nanoserve.model.attention import sdpa


def gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per row against that row's cached context.

    q: [rows, heads, head_dim]; k_cache/v_cache: [blocks, block_size, kv_heads, head_dim] (one layer);
    block_table: [rows, width] block ids (unused entries may be anything valid, e.g. the null block);
    context_lens: [rows] tokens each row attends to. Returns [rows, heads, head_dim].
    """
    # [rows, width*block, kv_heads, dim] -> a [rows, kv_heads, span, dim] view: no copy beyond the gather itself.
    k = k_cache[block_table].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
    span = k.shape[2]
    within = torch.arange(span, device=q.device)[None, :] < context_lens[:, None]
    out = sdpa(q.unsqueeze(2), k, v, mask=within[:, None, None, :], scale=scale)
    return out.squeeze(2)


