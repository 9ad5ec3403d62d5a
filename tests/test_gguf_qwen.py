"""Qwen2 (qkv biases) and Qwen3 (per-head q/k norms, a head_dim of its own) as GGUF files: tiny random models
written by transformers, converted with gguf's writer the way llama.cpp's converter lays them out (no q/k row
permutation for these architectures), and compared with transformers on the same weights and, where
llama-cpp-python is installed, with llama.cpp on the same file (vLLM's logprobs-close rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.model.gguf import load_gguf
from tests.gguf_fixtures import byte_level_vocab, write_llama_gguf
from tests.test_model_oracle import full_prefill_logits

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=1000000.0, rms_norm_eps=1e-6)
IDS = [[5, 80, 81, 200, 7, 9, 120, 33, 34, 35, 290, 12], [40], list(range(3, 90, 3))]


def _hf_model(kind: str, vocab: int):
    import transformers

    cfg_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    extra = {"head_dim": 32} if kind == "qwen3" else {}  # 4 heads of 32 on a hidden size of 64
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=vocab, tie_word_embeddings=False, **SHAPE, **extra)).float().eval()
    with torch.no_grad():  # biases and norm weights away from their zeros and ones, so a lost one shows
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.copy_(torch.randn_like(p) * 0.1 + (1 if "norm" in name
                                                                                           else 0))
    return model


def _gguf_of(model, kind: str, path, qtype: str = "F32"):
    cfg = model.config
    weights = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    extra = {"head_dim": cfg.head_dim} if kind == "qwen3" else {}
    return write_llama_gguf(path, weights, qtype=qtype, arch=kind, pre="qwen2", hidden=cfg.hidden_size,
                            intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                            context=cfg.max_position_embeddings, theta=SHAPE["rope_theta"], eps=cfg.rms_norm_eps, **extra)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen(request, tmp_path_factory):
    kind = request.param
    model = _hf_model(kind, len(byte_level_vocab()[0]))
    path = _gguf_of(model, kind, tmp_path_factory.mktemp(kind) / f"tiny-{kind}.gguf")
    return kind, model, path


def test_the_file_reads_back_as_the_checkpoint_it_came_from(qwen):
    kind, model, path = qwen
    ckpt = load_gguf(path)
    assert ckpt.config["architectures"] == [f"Qwen{kind[-1]}ForCausalLM"]
    assert ckpt.config["attention_bias"] == (kind == "qwen2")
    assert ckpt.config["head_dim"] == (32 if kind == "qwen3" else 16)
    theirs = model.state_dict()
    assert sorted(ckpt.tensors) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ckpt.tensors[name], tensor), name


def test_logits_match_transformers_on_the_same_weights(qwen):
    kind, model, path = qwen
    llm = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256, kv_cache_gib=0.01)
    for ids in IDS:
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(full_prefill_logits(llm, ids), theirs, rtol=1e-4, atol=1e-4)


def _llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's oracle needs llama-cpp-python (the peers "
                                                        "extra)")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)


def _close_logprobs(ours: torch.Tensor, theirs: torch.Tensor, k: int = 5) -> None:
    """vLLM's check_logprobs_close: where the greedy tokens differ, each side's token is in the other's top k."""
    a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
    for row in range(a.shape[0]):
        x, y = int(a[row].argmax()), int(b[row].argmax())
        if x != y:
            assert x in b[row].topk(k).indices and y in a[row].topk(k).indices, (row, x, y)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_logits_match_llama_cpp_on_the_same_file(qwen, tmp_path, qtype):
    kind, model, path = qwen
    if qtype != "F32":
        path = _gguf_of(model, kind, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    for ids in IDS:
        theirs = _llama_cpp_logits(path, ids)
        ours = full_prefill_logits(llm, ids)
        if qtype == "F32":  # llama.cpp keeps K and V in float16 (its default cache type): ~1e-3 apart
            torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=5e-3)
        _close_logprobs(ours, theirs)
