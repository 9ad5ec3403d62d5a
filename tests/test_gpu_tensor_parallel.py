"""Tensor parallelism on CUDA over NCCL (skipped without CUDA, and below two GPUs): the CPU suite's assertions on
the same tiny checkpoints, one rank per GPU."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine import StepFailed
from tests.test_tensor_parallel import PROMPTS, close_llm, logprob_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two GPUs")]

CUDA = dict(device="cuda", dtype="float32", max_model_len=256, kv_cache_gib=0.05)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_two_gpus_answer_as_one(tiny_checkpoint, kind):
    path = str(tiny_checkpoint(kind))
    one, two = LLM(model=path, **CUDA), LLM(model=path, tensor_parallel_size=2, **CUDA)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
        for prompt in PROMPTS[:4]:
            a, b = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for llm in (one, two))
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for row_a, row_b in zip(logprob_rows(a), logprob_rows(b), strict=True):
                assert max(abs(row_a[t] - row_b[t]) for t in row_a) < 1e-3
        assert two.engine.stats().features["parallel"]["backend"] == "nccl"
    finally:
        close_llm(two)


def test_a_killed_gpu_rank_is_named(tiny_checkpoint):
    two = LLM(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, distributed_timeout=20, **CUDA)
    try:
        two.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), use_tqdm=False)
        os.kill(two.engine.runner.parallel.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(StepFailed, match="rank 1"):
            two.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - started < 30
    finally:
        close_llm(two)
