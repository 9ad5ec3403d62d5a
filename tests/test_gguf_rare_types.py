"""GGUF's rarer types (Q5_0, Q5_1, IQ4_NL in blocks of 32; IQ4_XS, Q2_K, Q3_K) kept as the file holds them and run
on the K-quant library's integer dot products like the other K-quants (kernels/kquant.c; kernels/kdecode.c decodes
them for an embedding's lookup). Decoded bit for bit as gguf's reference on arbitrary blocks, each output close to
the float64 product and depending on its row alone, and a file mixing them all close to transformers on the
dequantized weights and to llama.cpp on the same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.gguf_oracles import (
    assert_crowd_is_solo,
    assert_near_llama_cpp,
    assert_near_transformers,
    kept_types,
    transformers_llama,
    write_mixed,
)
from tests.gguf_oracles import load as load_llm

RARE = ("Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K")
# where each type keeps its f16 scales: byte offsets within a block (random bytes there could be inf or NaN)
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}
# every rare type in one model, each projection in its own
MIX = {"q_proj.weight": "IQ4_XS", "k_proj.weight": "Q3_K", "v_proj.weight": "Q2_K", "o_proj.weight": "IQ4_NL",
       "gate_proj.weight": "Q5_0", "up_proj.weight": "Q5_1", "down_proj.weight": "Q3_K", "lm_head.weight": "Q2_K"}


def _random_blocks(qtype: str, out: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Arbitrary bytes as `qtype` blocks (every code, scale and sign pattern), their f16 scales finite; and
    gguf's float32 reading of them."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out * k // block, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        raw[:, at:at + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(out, k)
    return torch.from_numpy(raw.reshape(out, -1)), expected


@pytest.mark.parametrize("qtype", RARE)
def test_the_kernels_decoder_is_ggufs_bit_for_bit(kernels, qtype):
    raw, expected = _random_blocks(qtype, 24, 768, seed=1)
    rows = kernels.kq_dequant_rows(qtype, raw, 768, torch.arange(24))
    assert torch.equal(rows, torch.from_numpy(expected))
    assert torch.equal(KQuantBlocks(((qtype, raw),), 768).dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", RARE)
def test_the_product_is_close_to_float64_and_a_row_is_the_same_alone(kernels, qtype):
    raw, expected = _random_blocks(qtype, 40, 512, seed=2)
    linear = KQuantLinear(KQuantBlocks(((qtype, raw),), 512), None, None, kernels)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    y = linear(x)
    exact = x.double() @ torch.from_numpy(expected).double().T
    # activations in 8-bit codes per 256 (llama.cpp's Q8_K): well under 2% of the largest output
    assert (y.double() - exact).abs().max() < 2e-2 * exact.abs().max()
    for row in range(9):
        assert torch.equal(linear(x[row:row + 1].clone()), y[row:row + 1])


@pytest.fixture(scope="module")
def rare(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("rare") / "tiny-rare.gguf", MIX, "Q5_0")


def test_a_file_of_every_rare_type_keeps_them_and_matches_transformers(kernels, rare):
    weights, path = rare
    llm = load_llm(path)
    model = llm.engine.runner.model
    types = kept_types(llm)
    assert {("IQ4_XS", "Q3_K", "Q2_K"), ("IQ4_NL",), ("Q5_0", "Q5_1"), ("Q3_K",), ("Q2_K",)} <= types, types
    assert model.embed_tokens.weight.numel() == 0  # looked up in the file's Q5_0 blocks, no float32 table
    assert tuple(model.lm_head.packed.type_names) == ("Q2_K",)
    # 8-bit activation codes per 256 (llama.cpp's Q8_K): on this random model up to 5.5% of the largest logit from
    # the float32 product, as the K-quant file's (tests/test_gguf_kquants.py)
    assert_near_transformers(llm, transformers_llama(weights, MIX, "Q5_0"), 0.08)


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_rare_type_file(kernels, rare):
    assert_crowd_is_solo(rare[1], max_tokens=10)


def test_logits_match_llama_cpp_on_the_same_rare_type_file(kernels, rare):
    assert_near_llama_cpp(rare[1])
