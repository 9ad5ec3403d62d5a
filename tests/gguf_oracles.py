"""Oracles for a tiny llama GGUF file of mixed types: transformers on gguf's dequantization of the same weights,
llama.cpp on the same file, and the engine itself alone against a crowd."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.gguf_fixtures import byte_level_vocab, hf_weights, reference, write_llama_gguf
from tests.test_model_oracle import full_prefill_logits

SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
IDS = [[5, 80, 81, 200, 7, 9, 120, 33, 34, 35, 290, 12], [40], list(range(3, 90, 3))]
CROWD = ["hello world", "the test is", "def (", "hello " * 20, "in"]


VOCAB = len(byte_level_vocab()[0])
# Q4_K_M's pattern (v and the head in Q6_K), with down in Q5_K so every interleaved type runs in one model
Q4_K_M_MIX = {"v_proj.weight": "Q6_K", "down_proj.weight": "Q5_K", "lm_head.weight": "Q6_K"}


def write_mixed(path, types: dict[str, str], default: str) -> tuple[dict[str, np.ndarray], object]:
    """Random HF weights of SHAPE and the llama GGUF file holding them as `types` (an HF name ending -> type,
    `default` for the rest)."""
    weights = hf_weights(VOCAB, **SHAPE)
    return weights, write_llama_gguf(path, weights, qtype=default, tensor_types=types, **SHAPE)


def load(path) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)


def kept_types(llm: LLM) -> set[tuple[str, ...]]:
    """The type runs of every projection that multiplies the file's blocks (a merged one's runs in order)."""
    from nanoserve.model.quant.linears import KQuantLinear

    return {tuple(m.packed.type_names) for m in llm.engine.runner.model.modules()
            if isinstance(getattr(m, "packed", None), KQuantLinear)}


def transformers_llama(weights: dict[str, np.ndarray], types: dict[str, str], default: str):
    """transformers' Llama of SHAPE holding what gguf reads back from `weights` written as `types` (an HF name
    ending -> type, `default` for the rest): the float32 product the engine's blocks stand for."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    kind = {name: next((t for end, t in types.items() if name.endswith(end)), default) for name in weights}
    state = {name: torch.from_numpy(np.ascontiguousarray(reference(w, kind[name]) if w.ndim == 2 else w))
             for name, w in weights.items()}
    model.load_state_dict(state)
    return model


def assert_rows_logprobs_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """vLLM's logprobs-close rule, row by row of two [tokens, vocab] logits: the same top token, or each engine's
    top among the other's five highest."""
    a, b = ours.log_softmax(-1), theirs.log_softmax(-1)
    for row in range(a.shape[0]):
        x, y = int(a[row].argmax()), int(b[row].argmax())
        assert x == y or (x in b[row].topk(5).indices and y in a[row].topk(5).indices), (row, x, y)


def assert_near_transformers(llm: LLM, model, tolerance: float) -> None:
    """Every IDS prompt's logits within `tolerance` of the largest of transformers', and logprobs-close."""
    for ids in IDS:
        ours = full_prefill_logits(llm, ids)
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max() < tolerance * theirs.abs().max()
        assert_rows_logprobs_close(ours, theirs)


def assert_crowd_is_solo(path, max_tokens: int = 12) -> None:
    """Each CROWD prompt's greedy tokens the same generated alone and all together."""
    llm = load(path)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    solo = [llm.generate([p], params)[0].outputs[0].token_ids for p in CROWD]
    assert [o.outputs[0].token_ids for o in llm.generate(CROWD, params)] == solo


def assert_near_llama_cpp(path) -> None:
    """Every IDS prompt's logits logprobs-close to llama.cpp's on the same file (skipped without llama-cpp-python)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's oracle needs llama-cpp-python (the peers "
                                                        "extra)")
    llm = load(path)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    for ids in IDS:
        peer.reset()
        peer.eval(ids)
        theirs = torch.tensor(np.array(peer.scores[: len(ids)]), dtype=torch.float32)
        assert_rows_logprobs_close(full_prefill_logits(llm, ids), theirs)


def bits_on_every_isa(probe: str) -> dict[str, list[str]]:
    """What `probe` (Python source printing the build's ISA, then its outputs as hex) prints on each build
    $NANOSERVE_CPU_ISA makes (native, AVX2, plain C), by the ISA each reports: for tests that the builds agree
    bit for bit."""
    runs = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cap in ("native", "avx2", "portable"):
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "NANOSERVE_CPU_ISA": cap}, cwd=root)
        assert done.returncode == 0, done.stderr[-2000:]
        isa, *products = done.stdout.split()
        runs[isa] = products
    assert "portable" in runs and len(runs) >= 2, runs.keys()
    return runs
