"""The gathered read: copy each row's blocks into one [rows, width] rectangle and attend over it.

Simple and fast on small contexts; its cost is the rectangle, which grows with the longest row.
"""

from __future__ import annotations

import torch


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
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    k = k_cache[block_table].flatten(1, 2)  # [rows, width*block, kv_heads, dim]
    v = v_cache[block_table].flatten(1, 2)
    span = k.shape[1]
    qg = q.view(rows, kv_heads, group, dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [rows, kv_heads, group, span]
    beyond = torch.arange(span, device=q.device)[None, :] >= context_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [rows, kv_heads, group, dim]
    return out.reshape(rows, heads, dim)
