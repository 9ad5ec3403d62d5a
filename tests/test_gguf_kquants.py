"""GGUF's K-quants (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K) and IQ4_XS kept as the file holds them and multiplied by the fused library's K-quant
kernels (kernels/kquant.c): decoded bit for bit as gguf's reference does, each output depending on its row alone
and alike on every instruction set, and a mixed file (Q4_K_M's pattern, Q5_K too) running every projection in its
own type, close to transformers on the dequantized weights and to llama.cpp on the same file."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.fused import load
from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.gguf_fixtures import byte_level_vocab, hf_weights, reference, write_llama_gguf
from tests.kquant_encode import encode_k
from tests.test_model_oracle import full_prefill_logits

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")
VOCAB = len(byte_level_vocab()[0])
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
# Q4_K_M's pattern (v and the head in Q6_K), with down in Q5_K so every type runs in one model
MIX = {"v_proj.weight": "Q6_K", "down_proj.weight": "Q5_K", "lm_head.weight": "Q6_K"}
IDS = [[5, 80, 81, 200, 7, 9, 120, 33, 34, 35, 290, 12], [40], list(range(3, 90, 3))]


@pytest.fixture(scope="module")
def kernels():
    kernels, why = load()
    if kernels is None:
        pytest.skip(f"the fused kernels cannot run here: {why}")
    return kernels


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
    raw = encode(w, qtype)[0].reshape(32, -1)
    linear = KQuantLinear(KQuantBlocks(((qtype, torch.from_numpy(raw)),), 512), None, None, kernels)
    out.append(linear(torch.randn(5, 512, generator=torch.Generator().manual_seed(i))).numpy().tobytes().hex())
print(kernels.kq_isa, *out)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA caps are x86-64 builds")
def test_every_instruction_set_gives_the_same_bits(kernels):
    """The AVX-512, AVX2 and plain-C builds of the K-quant kernels (as $NANOSERVE_CPU_ISA builds them) agree bit
    for bit, every type of the table: their integer parts are exact and their float parts the same arithmetic
    lane by lane (the rarer types' plain path is one C code)."""
    runs = {}
    for cap in ("native", "avx2", "portable"):
        done = subprocess.run([sys.executable, "-c", _ISA_PROBE], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "NANOSERVE_CPU_ISA": cap}, cwd=os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__))))
        assert done.returncode == 0, done.stderr[-2000:]
        isa, *products = done.stdout.split()
        runs[isa] = products
    assert "portable" in runs and len(runs) >= 2, runs.keys()
    first = next(iter(runs.values()))
    assert all(products == first for products in runs.values()), sorted(runs)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    weights = hf_weights(VOCAB, **SHAPE)
    path = write_llama_gguf(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf", weights, qtype="Q4_K",
                            tensor_types=MIX, **SHAPE)
    return weights, path


def _transformers(weights: dict[str, np.ndarray]):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    kind = {name: next((t for end, t in MIX.items() if name.endswith(end)), "Q4_K") for name in weights}
    state = {name: torch.from_numpy(np.ascontiguousarray(reference(w, kind[name]) if w.ndim == 2 else w))
             for name, w in weights.items()}
    model.load_state_dict(state)
    return model


def test_a_mixed_file_runs_every_projection_in_its_own_type(kernels, mixed):
    weights, path = mixed
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    linear = llm.engine.stats().features["linear"]
    assert linear["format"] == "kquant" and linear["kquant_modules"] == 2 * 4, linear
    published = llm.engine.stats().features["fused"]["kquant"]  # what /health says runs these blocks
    assert published["isa"] == kernels.kq_isa and published["vectorized"] == (kernels.kq_isa != "portable")
    assert set(TYPES) <= set(published["types"])
    model = llm.engine.runner.model
    types = {tuple(m.packed.type_names) for m in model.modules() if isinstance(getattr(m, "packed", None),
                                                                                 KQuantLinear)}
    assert {("Q4_K",), ("Q5_K",), ("Q4_K", "Q6_K")} <= types, types  # qkv: q and k in Q4_K, v in Q6_K
    theirs_model = _transformers(weights)
    for ids in IDS:
        ours = full_prefill_logits(llm, ids)
        with torch.inference_mode():
            theirs = theirs_model(torch.tensor([ids])).logits[0]
        # 8-bit activation codes per 256 (llama.cpp's own format for these blocks) put both engines ~5% of the
        # largest logit from the float32 product on this random model (llama.cpp: 0.33 of 6.08; ours 0.34)
        assert (ours - theirs).abs().max() < 0.08 * theirs.abs().max()
        a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
        for row in range(a.shape[0]):  # vLLM's logprobs-close rule
            x, y = int(a[row].argmax()), int(b[row].argmax())
            assert x == y or (x in b[row].topk(5).indices and y in a[row].topk(5).indices), (row, x, y)


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_k_quant_file(kernels, mixed):
    _, path = mixed
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    prompts = ["hello world", "the test is", "def (", "hello " * 20, "in"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    crowd = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert crowd == solo


def test_logits_match_llama_cpp_on_the_same_file(kernels, mixed):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's oracle needs llama-cpp-python (the peers "
                                                        "extra)")
    _, path = mixed
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    for ids in IDS:
        peer.reset()
        peer.eval(ids)
        theirs = torch.tensor(np.array(peer.scores[: len(ids)]), dtype=torch.float32)
        ours = full_prefill_logits(llm, ids)
        a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
        for row in range(a.shape[0]):
            x, y = int(a[row].argmax()), int(b[row].argmax())
            assert x == y or (x in b[row].topk(5).indices and y in a[row].topk(5).indices), (row, x, y)


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
