"""Batch invariance on CUDA (skipped without CUDA): the same property as tests/test_determinism.py on a card.

A row's tokens and logprobs, run in a crowd with chunked prefill and the prefix cache, must be the bytes the same
request gives alone on an engine without either; in float32 and bfloat16, eager and with CUDA graphs. Where the
card's kernels cannot hold it (nanoserve/invariance.py's probes), the engine must say so rather than claim it.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM
from tests.determinism_helpers import alone, params, run

pytestmark = pytest.mark.gpu

CUDA = {"device": "cuda", "kv_cache_gib": 0.05, "max_model_len": 256}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def requests() -> list:
    prompts = [[5 + 7 * i + j for j in range(3 + 13 * i)] for i in range(8)]
    return [(p, params(i % 2 == 0, i, 12)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_row_on_cuda_is_the_same_whatever_shares_its_step(ckpt, dtype, graphs):
    flags = {**CUDA, "dtype": dtype, "cuda_graphs": graphs}
    reference = LLM(model=ckpt, enable_prefix_caching=False, **flags)
    crowd = LLM(model=ckpt, max_num_batched_tokens=32, max_num_seqs=8, **flags)
    assert crowd.engine.numerics.determinism == "batch-invariant", crowd.engine.numerics.determinism
    work = requests()
    want = alone(reference, work)
    assert run(crowd, work) == want
    assert run(crowd, work[::-1]) == want[::-1]  # again, now from the prefix cache
    if graphs:
        assert crowd.engine.stats().as_dict()["capture"]["replays"] > 0


def test_cuda_without_batch_invariance_says_so(ckpt):
    llm = LLM(model=ckpt, batch_invariant=False, **CUDA)
    assert llm.engine.numerics.determinism == "not batch-invariant (--no-batch-invariant)"
