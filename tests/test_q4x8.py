"""GGUF Q4_0 rows on q4x8 (kernels/q4x8.c): the 4-bit kernel's packing against 8-bit activation codes per 32, the
format llama.cpp multiplies Q4_0 by. Each output close to the float64 product of gguf's dequantized weights,
depending on its row alone and the same bits on every instruction set; a Q4_0 file runs every projection on it,
close to transformers on the same weights and to llama.cpp on the same file, and a crowd answers as each alone.
Q4_1 (the default model's type) stays on q4x16."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from nanoserve.model.quant.blocks import from_gguf
from nanoserve.model.quant.linears import PackedLinear, Q4Linear, Q4x8Linear
from nanoserve.model.quant.methods import method_for
from tests.gguf_oracles import (
    assert_crowd_is_solo,
    assert_near_llama_cpp,
    assert_near_transformers,
    bits_on_every_isa,
    transformers_llama,
    write_mixed,
)
from tests.gguf_oracles import load as load_llm


def _blocks(qtype: str, out: int, k: int, seed: int):
    w = np.random.default_rng(seed).standard_normal((out, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]).reshape(-1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(out, k)
    return from_gguf(raw, qtype, (out, k)), torch.from_numpy(expected)


def test_q4_0_takes_q4x8_and_q4_1_keeps_q4x16(kernels):
    for qtype, linear in (("Q4_0", Q4x8Linear), ("Q4_1", Q4Linear)):
        blocks = _blocks(qtype, 32, 64, 0)[0]
        assert type(method_for(blocks, kernels).process(blocks, None, None)) is linear


def test_the_product_is_close_to_float64_and_a_row_is_the_same_alone(kernels):
    blocks, expected = _blocks("Q4_0", 48, 320, seed=1)
    linear = Q4x8Linear(blocks, None, None, kernels)
    x = torch.randn(11, 320, generator=torch.Generator().manual_seed(2))
    y = linear(x)
    exact = x.double() @ expected.double().T
    # activations in 8-bit codes per 32 (llama.cpp's Q8_0): well under 2% of the largest output
    assert (y.double() - exact).abs().max() < 2e-2 * exact.abs().max()
    for row in range(11):
        assert torch.equal(linear(x[row:row + 1].clone()), y[row:row + 1])


_ISA_PROBE = """
import torch
from nanoserve.kernels.fused import load
from nanoserve.model.quant.linears import Q4x8Linear
from tests.test_q4x8 import _blocks
kernels, why = load()
assert kernels is not None, why
linear = Q4x8Linear(_blocks("Q4_0", 64, 512, 3)[0], None, None, kernels)
outs = [linear(torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))) for rows in (1, 5, 9)]
print(kernels.q4x8_isa, *(o.numpy().tobytes().hex() for o in outs))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA caps are x86-64 builds")
def test_every_instruction_set_gives_the_same_bits(kernels):
    """The AVX-512 VNNI, AVX2 and plain-C builds of q4x8 (as $NANOSERVE_CPU_ISA builds them) agree bit for bit:
    the same exact integers, the same float operations group by group."""
    runs = bits_on_every_isa(_ISA_PROBE)
    first = next(iter(runs.values()))
    assert all(products == first for products in runs.values()), sorted(runs)


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("q4_0") / "tiny-q4_0.gguf", {}, "Q4_0")


def test_a_q4_0_file_runs_on_q4x8_and_matches_transformers(kernels, q4_0_file):
    weights, path = q4_0_file
    llm = load_llm(path)
    formats = {m.format for m in llm.engine.runner.model.layers.modules() if isinstance(m, PackedLinear)}
    assert formats == {"q4x8"}
    # 8-bit activation codes per 32: on this random model within a few percent of the largest logit
    assert_near_transformers(llm, transformers_llama(weights, {}, "Q4_0"), 0.08)
    assert llm.engine.stats().features["linear"]["q4x8_calls"] > 0  # the counter saw them run


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_q4_0_file(kernels, q4_0_file):
    assert_crowd_is_solo(q4_0_file[1], max_tokens=10)


def test_logits_match_llama_cpp_on_the_same_q4_0_file(kernels, q4_0_file):
    assert_near_llama_cpp(q4_0_file[1])
