"""Phi-3 as a GGUF file: a tiny random model written by transformers, converted with gguf's writer the way
llama.cpp's converter lays it out (q, k, v in one attn_qkv tensor, gate and up in one ffn_up, no q/k row
permutation; LongRoPE as two factor tensors and the original context in the metadata), compared with
transformers on the same weights, its quantized forms with the dense file (vLLM's logprobs-close rule) and, where
llama-cpp-python is installed, with llama.cpp on the same file."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.model.gguf import load_gguf
from tests.gguf_fixtures import byte_level_vocab, write_llama_gguf
from tests.gguf_oracles import IDS, assert_near_llama_cpp, assert_rows_logprobs_close
from tests.test_model_oracle import full_prefill_logits

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i / 4 for i in range(8)]}


def _hf_model(vocab: int, longrope: bool, **shape):
    import transformers

    extra = dict(rope_scaling=LONGROPE, original_max_position_embeddings=512, max_position_embeddings=4096) \
        if longrope else dict(max_position_embeddings=256)
    torch.manual_seed(0)
    config = transformers.Phi3Config(vocab_size=vocab, tie_word_embeddings=False, pad_token_id=0,
                                     **{**SHAPE, **shape}, **extra)
    model = transformers.Phi3ForCausalLM(config).float().eval()
    with torch.no_grad():  # norm weights away from their ones, so a lost one shows
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.copy_(torch.randn_like(p) * 0.1 + 1)
    return model


def _gguf_of(model, path, qtype: str = "F32", tensor_types: dict | None = None):
    cfg = model.config
    weights = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    scaling = cfg.rope_parameters if cfg.rope_parameters.get("rope_type") == "longrope" else None
    extra_tensors, extra_kv = {}, {}
    if scaling:  # as convert_hf_to_gguf.py's Phi3MiniModel writes LongRoPE
        original = cfg.original_max_position_embeddings
        factor = cfg.max_position_embeddings / original
        extra_tensors = {f"rope_factors_{k}.weight": (np.array(scaling[f"{k}_factor"], dtype=np.float32), None)
                         for k in ("long", "short")}
        extra_kv = {"phi3.rope.scaling.attn_factor": math.sqrt(1 + math.log(factor) / math.log(original))}
    path = write_llama_gguf(path, weights, qtype=qtype, arch="phi3", pre="smollm", hidden=cfg.hidden_size,
                            intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                            context=cfg.max_position_embeddings, theta=SHAPE["rope_theta"], eps=cfg.rms_norm_eps,
                            extra_tensors=extra_tensors, extra_kv=extra_kv, tensor_types=tensor_types,
                            original_context=cfg.original_max_position_embeddings if scaling else None)
    return path


@pytest.fixture(scope="module", params=["plain", "longrope"])
def phi3(request, tmp_path_factory):
    model = _hf_model(len(byte_level_vocab()[0]), request.param == "longrope")
    folder = tmp_path_factory.mktemp(f"phi3-{request.param}")
    return request.param, model, folder, _gguf_of(model, folder / "tiny-phi3.gguf")


@pytest.fixture(scope="module")
def plain_phi3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3-plain")
    return folder, _gguf_of(_hf_model(len(byte_level_vocab()[0]), False), folder / "tiny-phi3.gguf")


def test_the_file_reads_back_as_the_checkpoint_it_came_from(phi3):
    kind, model, _, path = phi3
    ckpt = load_gguf(path)
    assert ckpt.config["architectures"] == ["Phi3ForCausalLM"]
    theirs = model.state_dict()
    assert sorted(ckpt.tensors) == sorted(theirs)  # the fused tensors as the checkpoint stores them
    for name, tensor in theirs.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    scaling = ckpt.config["rope_scaling"]
    assert (scaling is None) == (kind == "plain")
    if scaling:
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 512
        assert scaling["short_factor"] == pytest.approx(LONGROPE["short_factor"])


def test_logits_match_transformers_on_the_same_weights(phi3):
    _, model, _, path = phi3
    llm = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256, kv_cache_gib=0.01)
    for ids in IDS:
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(full_prefill_logits(llm, ids), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("types", [{"": "Q8_0"}, {"": "Q4_0"}, {"qkv_proj.weight": "Q6_K", "": "Q4_K"}],
                         ids=["Q8_0", "Q4_0", "Q4_K+Q6_K"])
def test_a_quantized_file_runs_its_blocks_as_its_dequantized_weights_do(plain_phi3, types):
    """The fused tensors' blocks split by rows at load, each projection then run in its file's type (the packed
    kernels, 8-bit activations), logprobs-close to the same file's weights dequantized (quantization none)."""
    folder, _ = plain_phi3
    # inputs in whole K-quant super-blocks of 256
    model = _hf_model(len(byte_level_vocab()[0]), False, hidden_size=256, intermediate_size=256)
    mixed = {end: t for end, t in types.items() if end}
    path = _gguf_of(model, folder / f"tiny-phi3-{'-'.join(types.values())}.gguf", qtype=types[""], tensor_types=mixed)
    dense = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256, kv_cache_gib=0.01)
    quant = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    linear = quant.engine.stats().features["linear"]
    assert linear["modules"] == linear[f"{linear['format']}_modules"] == 8, linear  # every projection in its blocks
    for ids in IDS:
        assert_rows_logprobs_close(full_prefill_logits(quant, ids), full_prefill_logits(dense, ids))


def test_logits_match_llama_cpp_on_the_same_file(phi3):
    assert_near_llama_cpp(phi3[3])


def test_two_ranks_split_the_fused_tensors_per_projection(plain_phi3):
    """Under tensor parallelism each rank takes its share of q, k and v (and gate, up) from the fused tensors."""
    from nanoserve import SamplingParams

    _, path = plain_phi3
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    one = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256, kv_cache_gib=0.01)
    two = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256, kv_cache_gib=0.01,
              tensor_parallel_size=2)
    try:
        for ids in IDS:
            a, b = (llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0] for llm in (one, two))
            assert a.token_ids == b.token_ids
            for row_a, row_b in zip(a.logprobs, b.logprobs, strict=True):
                assert max(abs(row_a[t].logprob - row_b[t].logprob) for t in row_a) < 2e-4
    finally:
        two.engine.close()
