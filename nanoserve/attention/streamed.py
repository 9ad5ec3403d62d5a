"""The streamed read: a Triton kernel that walks each row's KV tiles through the block table.

One program per (row, kv head, context split) holds that kv head's whole query group as a [G, D] tile (G padded
to 16 so tl.dot runs on tensor cores), and walks `block` tokens at a time straight out of the block pool with an
online softmax. The [rows, heads, 1, ctx] score rectangle never exists: the widest thing alive is one
[G, block] tile. When rows x kv heads are too few to fill the device, the context is split across programs and
the partial results merged (flash-decoding), so one long request still occupies the GPU.

On a machine without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, which importing
nanoserve sets before Triton can be imported): correct, and far slower than the gathered read.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from nanoserve.errors import ConfigError
from nanoserve.triton_env import COMPILED_EARLY

MIN_DOT = 16  # tl.dot needs operands of at least 16 along every axis
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _streamed_decode(
    Q, K, V, Table, Lens, Acc, Max, Sum,
    scale, stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr,
    block_size, tiles_per_split,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(Lens + row)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    q = q.to(tl.float32) if F32_DOT else q.to(K.dtype.element_ty)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(ctx, BLOCK))
    for t in range(first, last):
        pos = t * BLOCK + tl.arange(0, BLOCK)
        valid = pos < ctx
        block = tl.load(Table + row * stride_tr + pos // block_size, mask=valid, other=0)
        offs = block.to(tl.int64) * stride_kb + (pos % block_size) * stride_ks + kvh * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v)
        m = m_new
    base = ((row * tl.num_programs(1) + kvh) * SPLITS + split) * G_PAD
    tl.store(Acc + (base + g)[:, None] * D + d[None, :], acc)
    tl.store(Max + base + g, m)
    tl.store(Sum + base + g, total)


def check_runnable(device: torch.device) -> None:
    """Refuse, with the fix, a CPU process whose Triton was imported outside the interpreter."""
    if device.type != "cuda" and not (INTERPRETED and not COMPILED_EARLY):
        raise ConfigError("the streamed read on a CPU runs under Triton's interpreter, which must be chosen before "
                          "Triton is first imported: set TRITON_INTERPRET=1 in the environment (importing "
                          "nanoserve first also does it), or use the gathered read")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(rows: int, kv_heads: int, tiles: int, device: torch.device) -> int:
    """Context splits from shapes only: enough programs to cover the device's SMs twice, never a split without a
    tile. On the CPU (the interpreter runs programs one by one) one split."""
    if device.type != "cuda" or tiles <= 1:
        return 1
    sms = _multiprocessors(device)
    programs = rows * kv_heads
    return max(1, min(tiles, -(-2 * sms // programs))) if programs < 2 * sms else 1


def streamed_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, block: int, splits: int | None = None) -> torch.Tensor:
    """Same contract as `gathered_decode`: q [rows, heads, D], caches [blocks, block_size, kv_heads, D],
    block_table [rows, width], context_lens [rows] (each >= 1) -> [rows, heads, D] in q's dtype."""
    check_runnable(q.device)
    rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    g_pad = max(MIN_DOT, triton.next_power_of_2(group))
    tiles = -(-(block_table.shape[1] * block_size) // block)
    splits = splits or choose_splits(rows, kv_heads, tiles, q.device)
    tiles_per_split = -(-tiles // splits)
    acc = torch.empty(rows, kv_heads, splits, g_pad, dim, dtype=torch.float32, device=q.device)
    mx = torch.empty(rows, kv_heads, splits, g_pad, dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    q = q.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    launch = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with launch:  # Triton launches on the current device: make it q's (an engine on cuda:1, in any thread)
        _streamed_decode[(rows, kv_heads, splits)](
            q, k_cache, v_cache, table, context_lens, acc, mx, sm,
            scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            table.stride(0), block_size, tiles_per_split,
            GROUP=group, G_PAD=g_pad, D=dim, BLOCK=block, SPLITS=splits,
            F32_DOT=k_cache.dtype == torch.float32 or INTERPRETED,  # the interpreter's half-precision dot is wrong
        )
    return merge_splits(acc, mx, sm, group).to(q.dtype).reshape(rows, heads, dim)


def merge_splits(acc: torch.Tensor, mx: torch.Tensor, sm: torch.Tensor, group: int) -> torch.Tensor:
    """Combine per-split (acc, max, sum) into the softmax-weighted output: [rows, kv_heads, group, D]."""
    if acc.shape[2] == 1:  # one split: its weight is exactly 1 (every row has at least one token)
        return acc[:, :, 0, :group] / sm[:, :, 0, :group, None]
    top = mx.amax(dim=2, keepdim=True)
    weight = torch.exp(torch.where(mx == float("-inf"), float("-inf"), mx - top.clamp_min(-3.0e38)))
    out = (acc * weight[..., None]).sum(2) / (sm * weight).sum(2)[..., None]
    return out[:, :, :group]
