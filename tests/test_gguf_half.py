"""A 16-bit GGUF file (F16 or BF16 weights) runs in its own 16 bits: no float32 copy of its matrices. Its rows are
types of the K-quant library's table (kernels/kquant.c), multiplied against the float32 activations as they are,
each weight converted exactly and added in one rounding into a fixed lane: so the product is the float32 one up to
summation order, a row's bits depend on it alone, and the file is close to transformers on the same weights (far
closer than a quantized file) and to llama.cpp on the same file."""

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

HALF = ("F16", "BF16")


def _rows(qtype: str, out: int, k: int, seed: int, specials: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights stored as `qtype` (the file's bytes; with `specials` signed zeros, subnormals and the
    largest finite values among them), and gguf's float32 reading of them."""
    w = np.random.default_rng(seed).standard_normal((out, k)).astype(np.float32) * 0.05
    if specials:
        w[0, :8] = [0.0, -0.0, 1e-7, -3e-6, 6e-5, 65504.0 if qtype == "F16" else 1e30, -2.0, 0.5]
    data = w.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(out, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(out, k)
    return torch.from_numpy(raw), expected


def test_the_python_table_of_units_is_the_librarys(kernels):
    from nanoserve.model.quant.blocks import K_QUANT_UNITS

    assert K_QUANT_UNITS == kernels.kq_units


@pytest.mark.parametrize("qtype", HALF)
def test_the_rows_decode_exactly(kernels, qtype):
    raw, expected = _rows(qtype, 24, 96, seed=1, specials=True)
    assert torch.equal(kernels.kq_dequant_rows(qtype, raw, 96, torch.arange(24)), torch.from_numpy(expected))
    assert torch.equal(KQuantBlocks(((qtype, raw),), 96).dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", HALF)
def test_the_product_is_float32s_and_a_row_is_the_same_alone(kernels, qtype):
    raw, expected = _rows(qtype, 40, 352, seed=2)  # 352: whole runs of 32, not of 256
    linear = KQuantLinear(KQuantBlocks(((qtype, raw),), 352), None, None, kernels)
    x = torch.randn(9, 352, generator=torch.Generator().manual_seed(3))
    y = linear(x)
    exact = x.double() @ torch.from_numpy(expected).double().T
    # float32 activations, each product rounded once into its lane: float32's own error of a 352-long sum
    assert (y.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    for row in range(9):
        assert torch.equal(linear(x[row:row + 1].clone()), y[row:row + 1])


def test_a_row_not_in_whole_runs_of_32_is_refused_with_the_reason(kernels):
    raw, _ = _rows("F16", 4, 48, seed=4)
    with pytest.raises(ValueError, match="runs of 32"):
        KQuantLinear(KQuantBlocks((("F16", raw),), 48), None, None, kernels)


@pytest.fixture(scope="module", params=HALF)
def half_file(request, tmp_path_factory):
    qtype = request.param
    weights, path = write_mixed(tmp_path_factory.mktemp("half") / f"tiny-{qtype}.gguf", {}, qtype)
    return qtype, weights, path


def test_a_16_bit_file_keeps_its_bits_and_matches_transformers(kernels, half_file):
    qtype, weights, path = half_file
    llm = load_llm(path)
    model = llm.engine.runner.model
    assert kept_types(llm) == {(qtype,)}  # every projection in the file's 16 bits
    assert model.embed_tokens.weight.numel() == 0  # looked up in the file's rows, no float32 table
    assert tuple(model.lm_head.packed.type_names) == (qtype,)
    dense = [p for name, p in model.named_parameters() if p.dim() == 2 and p.numel()]
    assert not dense, [name for name, p in model.named_parameters() if p.dim() == 2 and p.numel()]
    # the same weights in float32, summed in another order: float32's rounding, nothing more
    assert_near_transformers(llm, transformers_llama(weights, {}, qtype), 1e-4)


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_16_bit_file(kernels, half_file):
    assert_crowd_is_solo(half_file[2], max_tokens=10)


def test_logits_match_llama_cpp_on_the_same_16_bit_file(kernels, half_file):
    assert_near_llama_cpp(half_file[2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_hf_checkpoint_keeps_its_bits_and_matches_transformers(kernels, tiny_checkpoint, dtype):
    """A Hugging Face checkpoint stored in 16 bits runs its matrices in those bits (the same table rows as a GGUF
    file's), not on a float32 copy; its logits are transformers' float32 ones on the same weights up to summation
    order, and --quantization none still gives the dense float32 model."""
    from transformers import AutoModelForCausalLM

    from nanoserve import LLM
    from tests.test_model_oracle import PROMPTS, full_prefill_logits

    path = tiny_checkpoint("qwen2", _dtype=dtype)
    llm = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01)
    name = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    assert kept_types(llm) == {(name,)}
    model = llm.engine.runner.model
    assert model.embed_tokens.weight.numel() == 0 and tuple(model.lm_head.packed.type_names) == (name,)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dense = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01, quantization="none")
    assert not kept_types(dense)
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0]
        for engine in (llm, dense):
            ours = full_prefill_logits(engine, ids)
            assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
