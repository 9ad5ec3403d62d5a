"""The streamed read in torch, for machines without CUDA: the Triton kernel's walk, tile by tile.

Each step reads `block` positions of every row straight from the block pool, scores them, and folds them into
a running (max, sum, accumulator) with an online softmax, so no more than one tile of scores is ever alive and
the [rows, width] rectangle the gathered read builds never exists. The arithmetic is the kernel's: float32
scores and accumulation whatever the cache's dtype. Rows shorter than the longest skip their empty tiles by mask;
no tile past the longest is walked, however wide a bucketed block table is.
It is the CPU's streamed read (the Triton kernel runs there only under its interpreter, hundreds of times
slower); with CUDA the Triton kernel runs.
"""

from __future__ import annotations

import torch


def tiled_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """Same contract as `gathered_decode`: q [rows, heads, D], caches [blocks, block_size, kv_heads, D],
    block_table [rows, width], context_lens [rows] (each >= 1) -> [rows, heads, D] in q's dtype."""
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    device = q.device
    qg = q.reshape(rows, kv_heads, group, dim).float()
    keys, values = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    lens = context_lens.to(device)[:, None]
    # Walk the tiles the longest row reaches, not the table's width: a bucketed step's table is as wide as
    # max_model_len, and a tile past every row's end only multiplies the sums by exp(0) and adds zeros (the same
    # bits), thousands of einsums a token for nothing. Reading the lengths is free here: this twin runs on the
    # CPU (with CUDA the Triton kernel stops each row at its own length on the device).
    width = min(block_table.shape[1] * block_size, int(context_lens.max()))
    m = torch.full((rows, kv_heads, group), float("-inf"), device=device)
    total = torch.zeros(rows, kv_heads, group, device=device)
    acc = torch.zeros(rows, kv_heads, group, dim, device=device)
    for start in range(0, width, block):
        pos = torch.arange(start, min(start + block, width), device=device)
        slots = block_table[:, pos // block_size] * block_size + pos % block_size  # [rows, tile]
        k, v = keys[slots].float(), values[slots].float()  # [rows, tile, kv_heads, D]
        s = torch.einsum("rkgd,rtkd->rkgt", qg, k) * scale
        s.masked_fill_(~(pos[None, :] < lens)[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row with no position in this tile yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("rkgt,rtkd->rkgd", p, v)
        m = m_new
    return (acc / total[..., None]).reshape(rows, heads, dim).to(q.dtype)
