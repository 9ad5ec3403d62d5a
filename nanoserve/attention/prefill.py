"""Prefill attention: fresh segments attend causally to themselves; a segment that continues a sequence (a later
chunk of a long prompt, or a prompt whose head came from the prefix cache) also reads its past from the paged
cache.

The continuing case is split in two and merged by log-sum-exp, as flash-decoding merges its splits:

- **the past** (positions before the chunk) is visible to every query of the chunk, so it needs no mask. It is
  gathered from the cache once per layer for all the segments whose pasts are the same blocks (a crowd sharing a
  system prompt), and all their queries score it in one unmasked call, each group of query heads folded into the
  query length so the grouped-query kv heads are read as they are;
- **the chunk itself** is plain causal attention on its own fresh K/V, which never go back through the cache.

A single call with a [chunk, past + chunk] mask gives the same numbers, but a mask forces torch's CPU kernel off
its fast path: the split is about 3x faster per layer at a 512-token chunk after 2,048 cached tokens
(`nanoserve bench prefix` shows it end to end). It needs the attention's log-sum-exp, which only torch's CPU flash
kernel hands back; elsewhere (CUDA, or a torch without that kernel) one masked call over the gathered past and the
fresh chunk is used instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanoserve.attention.sdpa import sdpa


@dataclass(frozen=True)
class SharedPast:
    """Continuing segments of one step whose pasts are the same `length` tokens in the same cache `blocks`."""

    length: int
    blocks: torch.Tensor  # [ceil(length / block_size)] cache blocks holding the past
    members: tuple[int, ...]  # indices into the step's prefill segments, in order


def share_pasts(segments, block_tables: list[list[int]], block_size: int, device) -> tuple[SharedPast, ...]:
    """Group the continuing segments by the blocks their pasts live in (once per step, not per layer).

    Two segments share a past only when it is the same number of tokens in the same blocks: a block holding
    part of a past is either a full cached block (immutable, shareable) or the sequence's own partial block.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (seg, table) in enumerate(zip(segments, block_tables)):
        if seg.context_start:
            past = tuple(table[: -(-seg.context_start // block_size)])
            groups.setdefault((seg.context_start, past), []).append(i)
    return tuple(
        SharedPast(length, torch.tensor(past, dtype=torch.long, device=device), tuple(members))
        for (length, past), members in groups.items()
    )


def _probe_flash_lse():
    """torch's CPU flash kernel with its log-sum-exp, if this torch has it and it agrees with the public sdpa."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:
        q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
        out, lse = op(q, q, q, is_causal=True, scale=0.5)
        want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.5)
        if lse.shape != (1, 2, 3) or not torch.allclose(out, want, atol=1e-5):
            return None
    except (RuntimeError, TypeError):
        return None
    return op


_FLASH_LSE = _probe_flash_lse()
_forced: bool | None = None  # set by `forced_split` (benchmarks compare the two paths in one process)


@contextmanager
def forced_split(split: bool):
    """Run every prefill with the split path (True) or the one masked call (False) inside this block, so a
    benchmark can interleave the two on one engine. Outside it each device takes its own default."""
    global _forced
    if split and _FLASH_LSE is None:
        raise RuntimeError("the split prefill needs torch's CPU flash kernel with log-sum-exp, absent here")
    previous, _forced = _forced, split
    try:
        yield
    finally:
        _forced = previous


def prefill_attention(q, k, v, segments, pasts: tuple[SharedPast, ...], k_cache, v_cache, scale: float,
                      split: bool | None = None) -> torch.Tensor:
    """Attention for every prefill segment of the step, concatenated in segment order: [tokens, heads, dim].

    q [step tokens, heads, dim] and k/v [step tokens, kv_heads, dim] are the whole step's (segments index into
    them); k_cache/v_cache one layer's [blocks, block_size, kv_heads, dim]. `split` forces the split path on or
    off (tests); by default it is used where the kernel that returns the log-sum-exp runs.
    """
    if split is None:
        split = _forced if _forced is not None else _FLASH_LSE is not None and q.device.type == "cpu"
    outs: list = [None] * len(segments)
    past_of = {}
    for group in pasts:
        keys, values = _gather_past(group, k_cache, v_cache)
        if split:
            scored = _score_past(q, [segments[i] for i in group.members], keys, values, scale)
            past_of.update(zip(group.members, scored))
        else:
            past_of.update((i, (keys, values)) for i in group.members)
    for i, seg in enumerate(segments):
        sl = slice(seg.start, seg.start + seg.length)
        if not seg.context_start:
            outs[i] = _causal(q[sl], k[sl], v[sl], scale)
        elif split:
            outs[i] = _merge(*past_of[i], *_causal_lse(q[sl], k[sl], v[sl], scale)).to(q.dtype)
        else:
            outs[i] = _masked(q[sl], k[sl], v[sl], *past_of[i], scale)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _gather_past(group: SharedPast, k_cache, v_cache):
    """The past's K/V as [kv_heads, length, dim], read from its blocks once for the whole group."""
    keys = k_cache.index_select(0, group.blocks).flatten(0, 1)[: group.length]
    values = v_cache.index_select(0, group.blocks).flatten(0, 1)[: group.length]
    return keys.transpose(0, 1), values.transpose(0, 1)


def _score_past(q, members, keys, values, scale) -> list[tuple]:
    """(output, log-sum-exp) of each member's queries against the shared past, from one unmasked call.

    With no mask, a query's position does not matter, so the `group` query heads that share a kv head are laid
    along the query length: [kv_heads, group * tokens, dim] against the past's [kv_heads, length, dim].
    """
    kv_heads, _, dim = keys.shape
    heads = q.shape[1]
    group = heads // kv_heads
    lengths = [seg.length for seg in members]
    rows = torch.cat([q[seg.start: seg.start + seg.length] for seg in members])  # [tokens, heads, dim]
    folded = rows.reshape(-1, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
    out, lse = _FLASH_LSE(folded, keys[None], values[None], scale=scale)
    out = out.view(kv_heads, group, -1, dim).permute(2, 0, 1, 3).reshape(-1, heads, dim)  # [tokens, heads, dim]
    lse = lse.view(kv_heads, group, -1).permute(2, 0, 1).reshape(-1, heads)  # [tokens, heads]
    return list(zip(out.split(lengths), lse.split(lengths)))


def _causal_lse(q, k, v, scale):
    """(output, log-sum-exp) of a chunk's causal attention to itself, as [tokens, heads, dim] and [tokens, heads]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = _FLASH_LSE(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          is_causal=True, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Softmax over the union of two key sets from each one's normalised output and log-sum-exp (in float32)."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a.float() * wa + out_b.float() * wb) / (wa + wb)


def _causal(q, k, v, scale) -> torch.Tensor:
    return sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True, scale=scale).transpose(0, 1)


def _masked(q, k, v, past_k, past_v, scale) -> torch.Tensor:
    """One call over [past, chunk] with the chunk's causal mask aligned to its end (the path without the LSE)."""
    length, past = q.shape[0], past_k.shape[1]
    keys = torch.cat([past_k, k.transpose(0, 1)], dim=1)
    values = torch.cat([past_v, v.transpose(0, 1)], dim=1)
    rows = torch.arange(length, device=q.device)[:, None] + past
    mask = torch.arange(past + length, device=q.device)[None, :] <= rows
    return sdpa(q.transpose(0, 1), keys, values, mask=mask, scale=scale).transpose(0, 1)
