"""GGUF's K-quants (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K) and IQ4_XS kept as the file holds them and multiplied by the
fused library's K-quant kernels (kernels/kquant.c): decoded bit for bit as gguf's reference does, each output depending on its row alone
and alike on every instruction set, and a mixed file (Q4_K_M's pattern, Q5_K too) running every projection in its
own type, close to transformers on the dequantized weights and to llama.cpp on the same file."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.gguf_fixtures import hf_weights, reference, write_llama_gguf
from tests.gguf_oracles import (
    Q4_K_M_MIX,
    SHAPE,
    VOCAB,
    assert_crowd_is_solo,
    assert_near_llama_cpp,
    assert_near_transformers,
    bits_on_every_isa,
    kept_types,
    transformers_llama,
    write_mixed,
)
from tests.gguf_oracles import load as load_llm
from tests.kquant_encode import encode_k

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")
MIX = Q4_K_M_MIX


def _blocks(qtype: str, out: int = 48, k: int = 512, seed: int = 0) -> tuple[KQuantBlocks, np.ndarray]:
    """Random weights as `qtype` blocks, and gguf's float32 reading of them."""
    w = np.random.default_rng(seed).standard_normal((out, k)).astype(np.float32) * 0.05
    raw = encode_k(w, qtype)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(out, k)
    return KQuantBlocks(((qtype, torch.from_numpy(raw)),), k), expected


@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernels_decoder_is_ggufs_bit_for_bit(kernels, qtype):
    blocks, expected = _blocks(qtype)
    assert torch.equal(KQuantLinear(blocks, None, None, kernels).dequantize(), torch.from_numpy(expected))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_product_is_close_to_float64_and_a_row_is_the_same_alone(kernels, qtype):
    blocks, expected = _blocks(qtype)
    linear = KQuantLinear(blocks, None, None, kernels)
    x = torch.randn(7, blocks.shape[1], generator=torch.Generator().manual_seed(1))
    y = linear(x)
    exact = x.double() @ torch.from_numpy(expected).double().T
    # activations in 8-bit codes per 256 (llama.cpp's Q8_K): well under 2% of the largest output
    assert (y.double() - exact).abs().max() < 2e-2 * exact.abs().max()
    for row in range(7):
        assert torch.equal(linear(x[row:row + 1].clone()), y[row:row + 1])


_ISA_PROBE = """
import sys, numpy as np, torch
from nanoserve.kernels.fused import load
from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.gguf_fixtures import encode
kernels, why = load()
assert kernels is not None, why
out = []
for i, qtype in enumerate(sorted(kernels.kq_types)):
    w = np.random.default_rng(i).standard_normal((32, 512)).astype(np.float32) * 0.05
    raw = np.ascontiguousarray(encode(w, qtype)[0]).view(np.uint8).reshape(32, -1)  # F16: float16 values
    linear = KQuantLinear(KQuantBlocks(((qtype, torch.from_numpy(raw)),), 512), None, None, kernels)
    out.append(linear(torch.randn(5, 512, generator=torch.Generator().manual_seed(i))).numpy().tobytes().hex())
print(kernels.kq_isa, *out)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA caps are x86-64 builds")
def test_every_instruction_set_gives_the_same_bits(kernels):
    """The AVX-512, AVX2 and plain-C builds of the K-quant kernels (as $NANOSERVE_CPU_ISA builds them) agree bit
    for bit, every type of the table: their integer parts are exact and their float parts the same arithmetic
    lane by lane (the rarer types' plain path is one C code)."""
    runs = bits_on_every_isa(_ISA_PROBE)
    first = next(iter(runs.values()))
    assert all(products == first for products in runs.values()), sorted(runs)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf", MIX, "Q4_K")


def test_a_mixed_file_runs_every_projection_in_its_own_type(kernels, mixed):
    weights, path = mixed
    llm = load_llm(path)
    linear = llm.engine.stats().features["linear"]
    assert linear["format"] == "kquant" and linear["kquant_modules"] == 2 * 4, linear
    published = llm.engine.stats().features["fused"]["kquant"]  # what /health says runs these blocks
    assert published["isa"] == kernels.kq_isa and published["vectorized"] == (kernels.kq_isa != "portable")
    assert set(TYPES) <= set(published["types"])
    types = kept_types(llm)
    assert {("Q4_K",), ("Q5_K",), ("Q4_K", "Q6_K")} <= types, types  # qkv: q and k in Q4_K, v in Q6_K
    # 8-bit activation codes per 256 (llama.cpp's own format for these blocks) put both engines ~5% of the
    # largest logit from the float32 product on this random model (llama.cpp: 0.33 of 6.08; ours 0.34)
    assert_near_transformers(llm, transformers_llama(weights, MIX, "Q4_K"), 0.08)


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_k_quant_file(kernels, mixed):
    assert_crowd_is_solo(mixed[1])


def test_logits_match_llama_cpp_on_the_same_file(kernels, mixed):
    assert_near_llama_cpp(mixed[1])


def _file_mappings(path) -> int:
    """How many of this process's mappings map `path` (/proc/self/maps): a tensor's blocks are one each."""
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/maps")
def test_a_load_lets_go_of_each_tensors_file_pages_once_it_is_packed(kernels, tmp_path, monkeypatch):
    """The file is mapped tensor by tensor; a tensor the load repacks must not stay mapped (its pages resident)
    until the whole load ends, or the peak is the file and its packed copy at once (3B Q4_K_M 3.8 GiB against 2.3
    now). By the last layer's packing, the first layer's mappings are gone."""
    from nanoserve.kernels.fused import FusedKernels

    path = tmp_path / "mixed.gguf"
    write_mixed(path, MIX, "Q4_K")
    seen = []
    pack = FusedKernels.kx16_pack

    def counting_pack(self, *args, **kwargs):
        seen.append(_file_mappings(path))
        return pack(self, *args, **kwargs)

    monkeypatch.setattr(FusedKernels, "kx16_pack", counting_pack)
    LLM(model=str(path), dtype="float32", max_model_len=64, kv_cache_gib=0.01)
    tensors_per_layer = 7
    assert len(seen) >= 2 * 3  # qkv, gate_up, down in each of the two layers (the head too)
    assert seen[-1] <= seen[0] - tensors_per_layer, seen
    assert _file_mappings(path) == 2  # only what runs in the file's own bytes: the embedding's rows and the head


def test_a_tied_k_quant_embedding_is_looked_up_and_multiplied_in_the_files_bytes(kernels, tmp_path):
    """llama.cpp writes the embedding in Q6_K; tied, it is the head too. Neither holds a float32 copy: a lookup
    decodes the rows asked exactly as gguf does, the head multiplies the same bytes, and an id past the vocabulary
    is an IndexError rather than a read outside the table."""
    from nanoserve.model.quant.linears import KQuantRows

    weights = hf_weights(VOCAB, tie=True, **SHAPE)
    path = write_llama_gguf(tmp_path / "tied-q6k-embedding.gguf", weights, qtype="Q4_K",
                            tensor_types={"embed_tokens.weight": "Q6_K"}, **SHAPE)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    model = llm.engine.runner.model
    embedding = model.embed_tokens
    assert embedding.weight.numel() == 0 and isinstance(embedding.rows_of, KQuantRows)
    head = model.lm_head.packed
    assert isinstance(head, KQuantLinear) and tuple(head.type_names) == ("Q6_K",)
    assert head.raw0.data_ptr() == embedding.rows_of.raw.data_ptr()  # one table, not two
    expected = torch.from_numpy(reference(weights["model.embed_tokens.weight"], "Q6_K"))
    ids = torch.tensor([[0, 5, VOCAB - 1], [7, 7, VOCAB - 2]])
    assert torch.equal(embedding(ids), expected[ids])
    with pytest.raises(IndexError, match="outside"):
        embedding(torch.tensor([VOCAB]))
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
