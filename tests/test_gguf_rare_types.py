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

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.fused import load
from nanoserve.model.quant import KQuantBlocks
from nanoserve.model.quant.linears import KQuantLinear
from tests.gguf_fixtures import byte_level_vocab, hf_weights, reference, write_llama_gguf
from tests.test_model_oracle import full_prefill_logits

RARE = ("Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K")
# where each type keeps its f16 scales: byte offsets within a block (random bytes there could be inf or NaN)
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}
VOCAB = len(byte_level_vocab()[0])
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
# every rare type in one model, each projection in its own
MIX = {"q_proj.weight": "IQ4_XS", "k_proj.weight": "Q3_K", "v_proj.weight": "Q2_K", "o_proj.weight": "IQ4_NL",
       "gate_proj.weight": "Q5_0", "up_proj.weight": "Q5_1", "down_proj.weight": "Q3_K", "lm_head.weight": "Q2_K"}
IDS = [[5, 80, 81, 200, 7, 9, 120, 33, 34, 35, 290, 12], [40], list(range(3, 90, 3))]


@pytest.fixture(scope="module")
def kernels():
    kernels, why = load()
    if kernels is None:
        pytest.skip(f"the fused kernels cannot run here: {why}")
    return kernels


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
    weights = hf_weights(VOCAB, **SHAPE)
    path = write_llama_gguf(tmp_path_factory.mktemp("rare") / "tiny-rare.gguf", weights, qtype="Q5_0",
                            tensor_types=MIX, **SHAPE)
    return weights, path


def _transformers(weights: dict[str, np.ndarray]):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    kind = {name: next((t for end, t in MIX.items() if name.endswith(end)), "Q5_0") for name in weights}
    state = {name: torch.from_numpy(np.ascontiguousarray(reference(w, kind[name]) if w.ndim == 2 else w))
             for name, w in weights.items()}
    model.load_state_dict(state)
    return model


def test_a_file_of_every_rare_type_keeps_them_and_matches_transformers(kernels, rare):
    weights, path = rare
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    model = llm.engine.runner.model
    types = {tuple(m.packed.type_names) for m in model.modules() if isinstance(getattr(m, "packed", None),
                                                                                 KQuantLinear)}
    assert {("IQ4_XS", "Q3_K", "Q2_K"), ("IQ4_NL",), ("Q5_0", "Q5_1"), ("Q3_K",), ("Q2_K",)} <= types, types
    assert model.embed_tokens.weight.numel() == 0  # looked up in the file's Q5_0 blocks, no float32 table
    assert tuple(model.lm_head.packed.type_names) == ("Q2_K",)
    theirs_model = _transformers(weights)
    for ids in IDS:
        ours = full_prefill_logits(llm, ids)
        with torch.inference_mode():
            theirs = theirs_model(torch.tensor([ids])).logits[0]
        # 8-bit activation codes per 256 (llama.cpp's Q8_K): on this random model up to 5.5% of the largest logit
        # from the float32 product, as the K-quant file's (tests/test_gguf_kquants.py)
        assert (ours - theirs).abs().max() < 0.08 * theirs.abs().max()
        a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
        for row in range(a.shape[0]):  # vLLM's logprobs-close rule
            x, y = int(a[row].argmax()), int(b[row].argmax())
            assert x == y or (x in b[row].topk(5).indices and y in a[row].topk(5).indices), (row, x, y)


def test_a_row_is_the_same_in_a_crowd_as_alone_on_a_rare_type_file(kernels, rare):
    _, path = rare
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    prompts = ["hello world", "the test is", "def (", "hello " * 20, "in"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    solo = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    crowd = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert crowd == solo


def test_logits_match_llama_cpp_on_the_same_rare_type_file(kernels, rare):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's oracle needs llama-cpp-python (the peers "
                                                        "extra)")
    _, path = rare
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    for ids in IDS:
        peer.reset()
        peer.eval(ids)
        theirs = torch.tensor(np.array(peer.scores[: len(ids)]), dtype=torch.float32)
        ours = full_prefill_logits(llm, ids)
        a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
        for row in range(a.shape[0]):  # vLLM's logprobs-close rule
            x, y = int(a[row].argmax()), int(b[row].argmax())
            assert x == y or (x in b[row].topk(5).indices and y in a[row].topk(5).indices), (row, x, y)
