"""Data parallelism on CUDA, one replica per GPU (skipped without CUDA, and below two GPUs): the CPU suite's
assertions, each replica on its own device."""

from __future__ import annotations

import httpx
import pytest
import torch

from nanoserve.server.serve import DataParallel
from tests.helpers import tiny_server_running, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two GPUs")]

CUDA = dict(device="cuda", dtype="float32")
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5 6 7", "hello " * 30]


def _complete(server, prompt, salt):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_salt": salt})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_one_replica_per_gpu_answers_as_one_gpu(tiny_checkpoint):
    from nanoserve import LLM, SamplingParams

    path = tiny_checkpoint("llama")
    one = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01, **CUDA)
    want = [o.outputs[0].text for o in one.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                     use_tqdm=False)]
    with tiny_server_running(path, CUDA, data_parallel=DataParallel(2)) as server:
        health = httpx.get(server.url + "/health").json()
        assert health["device"] == "cuda:0, cuda:1"
        assert [r["status"] for r in health["data_parallel"]["replicas"]] == ["ready", "ready"]
        got = [_complete(server, p, f"{i}") for i, p in enumerate(PROMPTS * 2)]
        assert got == want * 2
        server.host.launcher.kill(1)
        assert wait_until(lambda: server.host.links[1].status == "ready", timeout=120)
        assert [_complete(server, p, f"after{i}") for i, p in enumerate(PROMPTS)] == want
