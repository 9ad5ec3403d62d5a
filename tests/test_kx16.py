"""Q4_K, Q5_K and Q6_K rows interleaved 16 outputs a super-block (kernels/kx16.c): which runs of rows take it, the packing
read back bit for bit, and the products equal, bit for bit, to a numpy reading of the arithmetic kx16.c's header
states (exact integers a super-block, then one float step an output), on activations quantized as llama.cpp's Q8_K.
The instruction sets' agreement is tests/test_kernel_isas.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.kquant_encode import encode_k

K = 512


def _raw(qtype: str, out: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((out, K)).astype(np.float32) * 0.05
    return torch.from_numpy(encode_k(w, qtype))


def _q8k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kquant.c's activations: codes round(x 127 / max |x|) to nearest even (at most 127), scale max |x| / 127 per
    256, code sums per 16."""
    blocks = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), np.float32(0)).astype(np.float32)
    codes = np.minimum(np.rint(blocks * inv), 127).astype(np.int64)
    return codes, (top[..., 0] / np.float32(127)).astype(np.float32), codes.reshape(*codes.shape[:2], 16, 16).sum(3)


def _k45_parts(raw: np.ndarray, five: bool) -> tuple:
    """A Q4_K or Q5_K row's super-blocks: d, dmin, the 8 scales and mins, the 256 codes (gguf's layout)."""
    b = raw.reshape(-1, 176 if five else 144)
    d, dmin = b[:, 0:2].copy().view(np.float16)[:, 0], b[:, 2:4].copy().view(np.float16)[:, 0]
    s = b[:, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | (s[:, 0:4] >> 6) << 4], 1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | (s[:, 4:8] >> 6) << 4], 1)
    qs = b[:, 48 if five else 16:].astype(np.int64).reshape(-1, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], 2).reshape(-1, 256)  # 64 t + i low, 64 t + 32 + i high
    if five:  # input 32 j + i's fifth bit: bit j of qh[i]
        qh = b[:, 16:48].astype(np.int64)
        codes = codes | np.concatenate([(qh >> j) & 1 for j in range(8)], 1) << 4
    return d.astype(np.float32), dmin.astype(np.float32), sc, m, codes


def _q6k_parts(raw: np.ndarray) -> tuple:
    b = raw.reshape(-1, 210).astype(np.int64)
    ql, qh, sc = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32), b[:, 192:208]
    sc = np.where(sc > 127, sc - 256, sc)
    d = raw.reshape(-1, 210)[:, 208:210].copy().view(np.float16)[:, 0].astype(np.float32)
    low = np.stack([ql & 15, ql >> 4], 2).reshape(-1, 2, 128)  # r < 64: low nibbles, else high
    high = np.stack([(qh >> (2 * t)) & 3 for t in range(4)], 2).reshape(-1, 2, 128)
    return d, sc, (low | high << 4).reshape(-1, 256)


def _reference(qtype: str, raw: torch.Tensor, x: np.ndarray) -> np.ndarray:
    """y = (y + (d dx) I) - (dmin dx) M (Q4_K, Q5_K) or y + (d dx) I (Q6_K) super-block after super-block, in
    float32."""
    codes, dx, sums = _q8k(x)
    out, blocks = raw.shape[0], K // 256
    y = np.zeros((x.shape[0], out), dtype=np.float32)
    for o in range(out):
        for b in range(blocks):
            xb = codes[:, b]
            if qtype in ("Q4_K", "Q5_K"):
                d, dmin, sc, m, q = (p[b] for p in _k45_parts(raw[o].numpy(), qtype == "Q5_K"))
                ints = ((q.reshape(8, 32) * xb.reshape(-1, 8, 32)).sum(2) * sc).sum(1)
                mins = ((sums[:, b, 0::2] + sums[:, b, 1::2]) * m).sum(1)
                step = y[:, o] + (d * dx[:, b]) * ints.astype(np.float32)
                y[:, o] = step - (dmin * dx[:, b]) * mins.astype(np.float32)
            else:
                d, sc, q = (p[b] for p in _q6k_parts(raw[o].numpy()))
                ints = ((q.reshape(16, 16) * xb.reshape(-1, 16, 16)).sum(2) * sc).sum(1) - 32 * (sums[:, b] * sc).sum(1)
                y[:, o] = y[:, o] + (d * dx[:, b]) * ints.astype(np.float32)
    return y


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_runs_of_16_outputs_are_interleaved_and_read_back_bit_for_bit(kernels, qtype):
    raw = _raw(qtype, 48)
    linear = KQuantLinear(KQuantBlocks(((qtype, raw),), K), None, None, kernels)
    assert [entry for entry, *_ in linear.segments] == ["kx16"]
    assert linear.raw0.numel() == kernels._kx16_bytes(kernels.kx16_types[qtype], 48, K)
    assert torch.equal(linear.file_rows(0)[1], raw)
    odd = KQuantLinear(KQuantBlocks(((qtype, raw[:40]),), K), None, None, kernels)  # not in 16s: the file's rows
    kept = KQuantLinear(KQuantBlocks(((qtype, raw),), K), None, None, kernels, interleave=False)
    assert [entry for entry, *_ in odd.segments] == [entry for entry, *_ in kept.segments] == ["kq"]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_product_is_the_stated_arithmetic_bit_for_bit(kernels, qtype, rows):
    raw = _raw(qtype, 32, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # a sub-block of zero codes
    y = KQuantLinear(KQuantBlocks(((qtype, raw),), K), None, None, kernels)(x)
    assert np.array_equal(y.numpy(), _reference(qtype, raw, x.numpy()))


def test_a_merged_projection_fills_each_runs_columns_and_a_row_is_the_same_alone(kernels):
    """q and k in Q4_K, v in Q6_K (Q4_K_M's pattern), one in a run the interleaving does not take."""
    parts = [("Q4_K", _raw("Q4_K", 32, 1)), ("Q6_K", _raw("Q6_K", 16, 2)), ("Q6_K", _raw("Q6_K", 8, 3))]
    merged = KQuantLinear(KQuantBlocks(tuple(parts), K), None, None, kernels)
    assert [entry for entry, *_ in merged.segments] == ["kx16", "kx16", "kq"]
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(4))
    y = merged(x)
    at = 0
    for name, raw in parts:
        alone = KQuantLinear(KQuantBlocks(((name, raw),), K), None, None, kernels)(x)
        assert torch.equal(y[:, at:at + raw.shape[0]], alone)
        at += raw.shape[0]
    for row in range(9):
        assert torch.equal(merged(x[row:row + 1].clone()), y[row:row + 1])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_tied_embedding_looks_its_rows_up_in_the_heads_interleaved_table(kernels, qtype):
    from nanoserve.model.quant.linears import KQuantRows

    raw = _raw(qtype, 48, seed=7)
    blocks = KQuantBlocks(((qtype, raw),), K)
    head = KQuantLinear(blocks, None, None, kernels)
    table = KQuantRows.of_head(head)
    assert table.interleaved and table.raw.data_ptr() == head.raw0.data_ptr()  # one table, not two
    ids = torch.tensor([[0, 15, 16, 47], [33, 33, 1, 46]])
    assert torch.equal(table(ids), KQuantRows(blocks, kernels)(ids))
    with pytest.raises(IndexError, match="outside"):
        table(torch.tensor([48]))
