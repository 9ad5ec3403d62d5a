"""Batch-invariant attention: a query's output depends on its own context only, never on what shares the step.

Every query of a step, a decode row or a token of a prefill chunk, is attended the same way over its whole
context, read from the paged cache after the step's own K/V were written:

- **scores** `s = scale * q.k` for keys [0, span), the span the context rounded up to TILE keys (more for a row in
  a step with longer rows), keys past the query's position masked to -inf by an additive bias;
- **weights** `p = softmax(s)` over the span: torch's last-dim softmax reduces one row lane by lane, so masked
  keys add exact zeros and a longer span changes nothing;
- **output** `sum over tiles t of p_t @ v_t`, TILE keys a tile, the tiles added in order (a float64 running sum):
  every values matmul has the same inner length whatever the span, so BLAS adds a query's products in the same
  order for a decode row alone, in a crowd, or inside a prefill.

The query heads that share a kv head are padded to a multiple of ROW_MULTIPLE rows, the shapes in which BLAS
computes a row independently of the others (the machine check in nanoserve/invariance.py confirms it here).
Keys are gathered head-major from a cache laid out [kv_heads, blocks, block_size, head_dim] (KVCache "heads"),
so each (kv head, row) is one contiguous span and no copy stands between the gather and the matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention.step import AttentionStep

TILE = 64  # keys a values matmul adds at a time; part of the numerics (changing it changes the last bits)
ROW_MULTIPLE = 4  # query rows of every matmul are padded to a multiple of this
QUERY_CHUNK = 128  # prefill tokens scored at once (bounds the [rows, span] scores; changes no number)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tiled_span(keys: int) -> int:
    """Keys read for a context of `keys`: whole tiles, at least one."""
    return round_up(max(keys, TILE), TILE)


def tiled_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_t p_t @ v_t over TILE-wide tiles, added in tile order: p [B, M, S] (S a multiple of TILE), v [B, S, D]."""
    batch, rows, span = p.shape
    tiles = span // TILE
    if tiles == 1:
        return torch.bmm(p, v)
    pt = p.view(batch, rows, tiles, TILE).transpose(1, 2).reshape(batch * tiles, rows, TILE)
    out = torch.bmm(pt, v.reshape(batch * tiles, TILE, v.shape[-1])).view(batch, tiles, rows, -1)
    return out.cumsum(1).select(1, -1)  # sequential (in float64 for float32), so trailing empty tiles add 0


def _gather(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` of a head-major cache layer [kv_heads, blocks, block_size, dim] (ids already offset by
    head * blocks) into `out` [len(ids), block_size * dim]."""
    return torch.index_select(cache.view(-1, cache.shape[2] * cache.shape[3]), 0, ids, out=out)


def _gather_buffers(ids: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a step's K and V gathers land, allocated by its first layer and rewritten by every other."""
    shape = (ids.numel(), cache.shape[2] * cache.shape[3])
    return tuple(torch.empty(shape, dtype=cache.dtype, device=cache.device) for _ in range(2))


def head_major_ids(blocks: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids [..] -> the same blocks of every kv head in the flattened head-major cache: [kv_heads * n]."""
    heads = torch.arange(kv_heads, device=blocks.device)[:, None] * num_blocks
    return (blocks.reshape(1, -1) + heads).reshape(-1)


def _prefill_queries(q: torch.Tensor, kv_heads: int, rows_to: int) -> torch.Tensor:
    """Prefill queries [tokens, heads, dim] -> [kv_heads, tokens * group (padded to rows_to), dim], rows ordered
    (token, head)."""
    tokens, heads, dim = q.shape
    group = heads // kv_heads
    qg = q.view(tokens, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, tokens * group, dim)
    return F.pad(qg, (0, 0, 0, rows_to - tokens * group)) if rows_to != tokens * group else qg


class DecodeRows:
    """One step's decode rows (one query token each) and what every layer shares: the gather index, the mask
    bias and the gather buffers."""

    def __init__(self, block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 num_blocks: int, kv_heads: int, group: int):
        rows, width = block_table.shape
        self.kv_heads, self.group = kv_heads, group
        self.span = tiled_span(width * block_size)
        if self.span != width * block_size:
            block_table = F.pad(block_table, (0, self.span // block_size - width))
        self.ids = head_major_ids(block_table, kv_heads, num_blocks)
        self.padded_group = round_up(group, ROW_MULTIPLE)
        hidden = torch.arange(self.span, device=block_table.device)[None, :] >= context_lens[:, None]
        bias = torch.zeros(rows, self.span, device=block_table.device).masked_fill_(hidden, float("-inf"))
        self.bias = bias[None, :, None, :].expand(kv_heads, rows, 1, self.span).reshape(kv_heads * rows, 1, self.span)
        self._buffers: tuple | None = None
        self._queries: torch.Tensor | None = None  # [kv_heads, rows, padded group, dim], its padding zeros

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [rows, heads, dim]; one layer's head-major caches -> [rows, heads, dim] in q's dtype."""
        rows, heads, dim = q.shape
        kv, g4, span = self.kv_heads, self.padded_group, self.span
        if self._buffers is None:
            self._buffers = _gather_buffers(self.ids, k_cache)
        k = _gather(k_cache, self.ids, self._buffers[0]).view(kv * rows, span, dim).float()
        v = _gather(v_cache, self.ids, self._buffers[1]).view(kv * rows, span, dim).float()
        qg = self._grouped_queries(q)
        scores = torch.baddbmm(self.bias, qg, k.transpose(1, 2), alpha=scale)
        out = tiled_values(scores.softmax(-1), v)
        return out.view(kv, rows, g4, dim)[:, :, : self.group].transpose(0, 1).reshape(rows, heads, dim).to(q.dtype)

    def _grouped_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [rows, heads, dim] as [kv_heads * rows, padded group, dim]: each row's query heads of one kv head,
        padded to a multiple of ROW_MULTIPLE, in float32. Written into one buffer every layer of the step reuses:
        one copy a layer instead of a pad and a reshape; the padding rows stay the zeros they were made."""
        rows, heads, dim = q.shape
        if self._queries is None:
            self._queries = torch.zeros(self.kv_heads, rows, self.padded_group, dim, device=q.device)
        self._queries[:, :, : self.group].copy_(q.view(rows, self.kv_heads, self.group, dim).transpose(0, 1))
        return self._queries.view(self.kv_heads * rows, self.padded_group, dim)


class PrefillSegmentRows:
    """One prefill segment (tokens [start, start + length) of a sequence whose context starts at
    `context_start`), attended over its whole context read back from the cache."""

    def __init__(self, start: int, length: int, context_start: int, blocks: torch.Tensor, block_size: int,
                 num_blocks: int, kv_heads: int):
        self.start, self.length, self.context_start = start, length, context_start
        self.span = tiled_span(context_start + length)
        table = blocks[: -(-(context_start + length) // block_size)]
        table = F.pad(table, (0, self.span // block_size - table.shape[0]))
        self.ids = head_major_ids(table, kv_heads, num_blocks)
        self.kv_heads = kv_heads
        self._masks: dict[int, tuple[torch.Tensor, int]] = {}  # chunk's first token -> (bias, span): every layer's
        self._buffers: tuple | None = None  # the K and V gather's output, written by every layer in turn

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [length, heads, dim] (the segment's queries) -> [length, heads, dim] in q's dtype."""
        length, heads, dim = q.shape
        kv = self.kv_heads
        group = heads // kv
        if self._buffers is None:
            self._buffers = _gather_buffers(self.ids, k_cache)
        keys = _gather(k_cache, self.ids, self._buffers[0]).view(kv, self.span, dim).float()
        values = _gather(v_cache, self.ids, self._buffers[1]).view(kv, self.span, dim).float()
        outs = []
        for first in range(0, length, QUERY_CHUNK):
            last = min(length, first + QUERY_CHUNK)
            outs.append(self._chunk(q[first:last].float(), first, keys, values, scale, group))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out.to(q.dtype)

    def _chunk(self, q, first: int, keys, values, scale: float, group: int) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv = self.kv_heads
        bias, span = self._mask(first, tokens, group, q.device)
        qg = _prefill_queries(q, kv, bias.shape[1])
        scores = torch.baddbmm(bias, qg, keys[:, :span].transpose(1, 2), alpha=scale)
        out = tiled_values(scores.softmax(-1), values[:, :span])
        return out[:, : tokens * group].view(kv, tokens, group, dim).transpose(0, 1).reshape(tokens, heads, dim)

    def _mask(self, first: int, tokens: int, group: int, device) -> tuple[torch.Tensor, int]:
        """The causal bias of the chunk starting at token `first` ([1, rows padded, span]: a row is one query head
        of one token), and the keys its last query can see in whole tiles; built by the step's first layer."""
        if first not in self._masks:
            rows = tokens * group
            padded = round_up(rows, ROW_MULTIPLE)
            top = self.context_start + first  # position of the chunk's first query
            span = tiled_span(top + tokens)
            positions = torch.arange(top, top + tokens, device=device).repeat_interleave(group)
            positions = F.pad(positions, (0, padded - rows), value=top)
            hidden = torch.arange(span, device=device)[None, :] > positions[:, None]
            bias = torch.zeros(1, padded, span, device=device).masked_fill_(hidden[None], float("-inf"))
            self._masks[first] = (bias, span)
        return self._masks[first]


class InvariantStep(AttentionStep):
    """The batch-invariant attention over one step: its decode rows (the step's first `num_decode` tokens) and
    its prefill segments, every token read from the cache, for every layer to call with its own queries. `read`
    is the PagedRead whose counters the decode rows are charged to."""

    def __init__(self, read, batch, cache):
        if cache.layout != "heads":
            raise ValueError("the batch-invariant attention reads a head-major KV cache (KVCache layout 'heads')")
        super().__init__(read, batch, cache)
        self.block_size, self.num_blocks, self.kv_heads = cache.block_size, cache.num_blocks, cache.kv_heads
        self.segments = tuple(
            PrefillSegmentRows(seg.start, seg.length, seg.context_start,
                               torch.tensor(table, dtype=torch.long, device=cache.k.device), cache.block_size,
                               cache.num_blocks, cache.kv_heads)
            for seg, table in zip(batch.prefills, batch.prefill_tables))
        if len(self.segments) != len(batch.prefills):
            raise ValueError(f"the batch has {len(batch.prefills)} prefill segments but block tables for "
                             f"{len(batch.prefill_tables)}")
        self._decode: DecodeRows | None = None

    def attend(self, layer: int, q: torch.Tensor, k=None, v=None, scale: float = 1.0) -> torch.Tensor:
        """Attention for every token of the step, in token order: q [tokens, heads, dim] -> the same shape, over
        `layer`'s cache (the step's own k and v are already there)."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        nd = self.batch.num_decode
        parts = []
        if nd:
            if self._decode is None:
                self._decode = DecodeRows(self.batch.decode_block_table, self.batch.decode_context_lens,
                                          self.block_size, self.num_blocks, self.kv_heads, q.shape[1] // self.kv_heads)
            self.read.charge(nd, q.shape[1], self._decode.span)
            parts.append(self._decode.attend(q[:nd], k_cache, v_cache, scale))
        for seg in self.segments:
            parts.append(seg.attend(q[seg.start: seg.start + seg.length], k_cache, v_cache, scale))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
