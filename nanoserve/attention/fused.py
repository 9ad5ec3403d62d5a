"""The batch-invariant attention on the fused CPU kernel (nanoserve/kernels/fused.c, ns_attention).

Each query is attended over exactly the keys its position may see, straight from the paged cache: no gather, no
mask, no padding to a tile, one call a layer for the whole step. A query's numbers are a function of its own
keys only, so decode rows, prefill chunks, cached prefixes and crowds agree bitwise, as with the torch
invariant attention (invariant.py), whose numbers these are not: a model runs one or the other for every token.
"""

from __future__ import annotations

import torch

from nanoserve.attention.step import AttentionStep

PARALLEL_FROM = 256  # query x key pairs of a step from which its attention runs on torch's thread count (on the
# kernels' pool, already running: one decode row over 200 keys gains; its step read 1,700 keys in 13.9 ms, not 18.8)


def step_tables(batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables [rows, width] block ids, row_of [tokens], keys_of [tokens]) for a step: decode rows first (one
    token each, over their context), then one table row per prefill segment, whose tokens see their sequence
    up to and including themselves."""
    nd = batch.num_decode
    decode = batch.decode_block_table
    if not batch.prefills:
        return decode.contiguous(), torch.arange(nd), batch.decode_context_lens.contiguous()
    blocks = batch.prefill_tables
    width = max([decode.shape[1] if nd else 0, *(len(b) for b in blocks)])
    tables = torch.zeros(nd + len(blocks), width, dtype=torch.long)
    if nd:
        tables[:nd, : decode.shape[1]] = decode
    rows, keys = [torch.arange(nd)], [batch.decode_context_lens[:nd]]
    for s, (seg, seg_blocks) in enumerate(zip(batch.prefills, blocks)):
        tables[nd + s, : len(seg_blocks)] = torch.tensor(seg_blocks, dtype=torch.long)
        rows.append(torch.full((seg.length,), nd + s, dtype=torch.long))
        keys.append(torch.arange(seg.context_start + 1, seg.context_start + seg.length + 1))
    return tables, torch.cat(rows), torch.cat(keys)


class FusedInvariantStep(AttentionStep):
    """One step's attention for every layer to call with its queries (InvariantStep's shape): the layers write
    their k and v into the cache themselves (the fused rotary write), so `store` is never called here."""

    def __init__(self, read, batch, cache, kernels, out_dtype: torch.dtype):
        if cache.layout != "heads_kt":
            raise ValueError(f"the fused attention reads a heads_kt KV cache, not {cache.layout!r}")
        if len(batch.prefills) != len(batch.prefill_tables):
            raise ValueError(f"the batch has {len(batch.prefills)} prefill segments but block tables for "
                             f"{len(batch.prefill_tables)}")
        super().__init__(read, batch, cache)
        self.kernels, self.out_dtype, self.kv_heads = kernels, out_dtype, cache.kv_heads
        self.tables, self.row_of, self.keys_of = step_tables(batch, cache.block_size)
        self.max_keys = max(1, self.tables.shape[1] * cache.block_size)
        self.threads = torch.get_num_threads() if int(self.row_of.shape[0]) * self.max_keys >= PARALLEL_FROM else 1
        self._scratch: torch.Tensor | None = None  # allocated by the first layer, reused by the others
        self.num_decode = batch.num_decode
        self.width = batch.decode_block_table.shape[1] * cache.block_size if self.num_decode else 0

    def attend(self, layer: int, q: torch.Tensor, k=None, v=None, scale: float = 1.0) -> torch.Tensor:
        """q [tokens, heads, dim] float32 over `layer`'s cache -> [tokens, heads, dim] in the step's out dtype."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        if self.num_decode:
            self.read.charge(self.num_decode, q.shape[1], self.width)
        if self._scratch is None:
            self._scratch = self.kernels.attention_scratch(q.shape[1] // self.kv_heads, self.max_keys, q.shape[2],
                                                           self.threads)
        return self.kernels.attention(q, self.kv_heads, k_cache, v_cache, self.tables, self.row_of, self.keys_of,
                                      scale, self._scratch, self.max_keys, self.out_dtype, self.threads)
