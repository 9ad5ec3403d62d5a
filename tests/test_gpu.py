"""CUDA-only checks (skipped without CUDA): the engine on a GPU against transformers on the same GPU."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_greedy_matches_transformers(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3")
    llm = LLM(model=str(path), device="cuda", dtype="float32", max_model_len=256, kv_cache_gib=0.05)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = llm.tokenizer.encode("The quick brown fox")
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0].token_ids
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert list(ours) == theirs
    llm.engine.audit()


def test_cuda_pool_is_sized_from_free_memory(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cuda", gpu_memory_utilization=0.2)
    stats = llm.engine.stats()
    assert stats.kv.blocks_total > 1000
    free, total = torch.cuda.mem_get_info()
    assert stats.kv.bytes < 0.2 * total


@pytest.mark.default_model
def test_default_model_on_cuda_answers_paris():
    llm = LLM(device="cuda", max_model_len=2048)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
