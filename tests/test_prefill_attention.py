"""Prefill attention over the paged cache against a float64 dense oracle: fresh segments, chunks that continue a
sequence (past a block boundary or inside a block), and crowds whose pasts are the same cached blocks."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention import prefill
from nanoserve.attention.prefill import prefill_attention, share_pasts
from nanoserve.model.batch import PrefillSegment

BS, DIM = 4, 16


def dense_oracle(q, keys, values, past: int, scale: float) -> torch.Tensor:
    """Float64 softmax attention of q [len, heads, dim] over keys/values [past + len, kv_heads, dim], causal with
    the chunk's queries at positions past..past+len-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, len, past+len]
    rows = torch.arange(q.shape[0])[:, None] + past
    s = s.masked_fill(torch.arange(k.shape[1])[None, :] > rows, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


def build_step(spec, heads: int, kv_heads: int, dtype, seed: int = 0):
    """spec: (sequence id, past, chunk length) per segment; sequences with the same id share their blocks.
    Returns everything prefill_attention takes plus each segment's full keys/values for the oracle."""
    g = torch.Generator().manual_seed(seed)
    longest = max(p + n for _, p, n in spec)
    seqs = sorted({s for s, _, _ in spec})
    per_seq = -(-longest // BS)
    k_cache = torch.randn(len(seqs) * per_seq + 3, BS, kv_heads, DIM, generator=g).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=g).to(dtype)
    order = torch.randperm(k_cache.shape[0], generator=g).tolist()
    tables = {s: order[i * per_seq: (i + 1) * per_seq] for i, s in enumerate(seqs)}
    tokens = sum(n for _, _, n in spec)
    q = torch.randn(tokens, heads, DIM, generator=g).to(dtype)
    k = torch.empty(tokens, kv_heads, DIM, dtype=dtype)
    v = torch.empty_like(k)
    segments, seg_tables, full = [], [], []
    start = 0
    for s, past, n in spec:
        table = tables[s]
        slots = [table[p // BS] * BS + p % BS for p in range(past + n)]
        keys = k_cache.view(-1, kv_heads, DIM)[slots]
        values = v_cache.view(-1, kv_heads, DIM)[slots]
        k[start: start + n], v[start: start + n] = keys[past:], values[past:]  # the step's fresh rows
        segments.append(PrefillSegment(start, n, past))
        seg_tables.append(table)
        full.append((keys, values))
        start += n
    return q, k, v, segments, seg_tables, k_cache, v_cache, full


SPECS = {
    "fresh only": [(0, 0, 7), (1, 0, 3)],
    "past on a block boundary": [(0, 8, 5)],
    "past inside a block": [(0, 6, 9)],
    "one-token chunk after a long past": [(0, 13, 1)],
    "mixed fresh and continuing": [(0, 0, 5), (1, 8, 4), (2, 3, 6)],
    "a crowd sharing one past": [(0, 8, 3), (0, 8, 5), (0, 8, 1), (1, 0, 4)],
    "same blocks, different past lengths": [(0, 4, 2), (0, 8, 3)],
}


@pytest.mark.parametrize("split", [True, False], ids=["split", "masked"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("name", SPECS)
def test_prefill_attention_matches_dense_float64(name, heads, kv_heads, split):
    if split and prefill._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash kernel that returns its log-sum-exp")
    spec = SPECS[name]
    q, k, v, segments, tables, k_cache, v_cache, full = build_step(spec, heads, kv_heads, torch.float32)
    pasts = share_pasts(segments, tables, BS, "cpu")
    out = prefill_attention(q, k, v, segments, pasts, k_cache, v_cache, DIM**-0.5, split=split)
    assert out.shape == (len(q), heads, DIM) and out.dtype == torch.float32
    for seg, (keys, values) in zip(segments, full):
        got = out[seg.start: seg.start + seg.length]
        want = dense_oracle(q[seg.start: seg.start + seg.length], keys, values, seg.context_start, DIM**-0.5)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_bfloat16_cache_is_close_to_float64():
    if prefill._FLASH_LSE is None:
        pytest.skip("this torch has no CPU flash kernel that returns its log-sum-exp")
    spec = SPECS["mixed fresh and continuing"]
    q, k, v, segments, tables, k_cache, v_cache, full = build_step(spec, 6, 2, torch.bfloat16)
    out = prefill_attention(q, k, v, segments, share_pasts(segments, tables, BS, "cpu"), k_cache, v_cache, 0.25)
    assert out.dtype == torch.bfloat16
    for seg, (keys, values) in zip(segments, full):
        want = dense_oracle(q[seg.start: seg.start + seg.length], keys, values, seg.context_start, 0.25)
        torch.testing.assert_close(out[seg.start: seg.start + seg.length].double(), want, atol=2e-2, rtol=2e-2)


def test_segments_share_a_past_only_when_it_is_the_same_tokens_in_the_same_blocks():
    spec = [(0, 8, 3), (0, 8, 5), (1, 8, 2), (0, 4, 2), (0, 0, 4), (0, 8, 1)]
    _, _, _, segments, tables, _, _, _ = build_step(spec, 4, 2, torch.float32)
    pasts = share_pasts(segments, tables, BS, "cpu")
    assert sorted(p.members for p in pasts) == [(0, 1, 5), (2,), (3,)]
    for p in pasts:
        assert p.blocks.tolist() == tables[p.members[0]][: -(-p.length // BS)]


def test_cpu_uses_the_split_path_by_default():
    """The fast path is the default where it can run: a torch that lost the kernel shows up here, not as a
    silent 3x slowdown."""
    assert prefill._FLASH_LSE is not None, "torch's CPU flash kernel with log-sum-exp is missing on this torch"
