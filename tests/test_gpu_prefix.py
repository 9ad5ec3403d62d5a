"""Prefix caching on CUDA (skipped without CUDA): with CUDA graphs, the compiled streamed kernel and every fast-path
switch, a crowd that shares prefixes gets the bytes the engine without caching gives, with the audit clean after
every step. On CUDA a chunk that continues a sequence takes the one masked call (no log-sum-exp kernel there)."""

from __future__ import annotations

import pytest

from tests.test_prefix_cache import crowd, make, run_audited

pytestmark = pytest.mark.gpu

CUDA = {"device": "cuda", "dtype": "float32", "kv_cache_gib": 0.05}
FAST = {"decode_buckets": True, "persistent_inputs": True, "row_compaction": True}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("flags", [
    {},
    {**FAST, "cuda_graphs": True},
    {**FAST, "cuda_graphs": True, "streamed_read": True, "batch_invariant": False},
    {"streamed_read": True, "batch_invariant": False, "max_num_batched_tokens": 24, "max_num_seqs": 4},  # chunks from cached blocks
], ids=["eager", "graphs", "graphs-streamed", "streamed-chunked"])
def test_cuda_outputs_equal_the_engine_without_caching(ckpt, flags):
    cold_llm = make(ckpt, caching=False, **CUDA, **flags)
    cold = run_audited(cold_llm, crowd(cold_llm.engine.tokenizer))
    llm = make(ckpt, caching=True, **CUDA, **flags)
    assert run_audited(llm, crowd(llm.engine.tokenizer)) == cold
    stats = llm.engine.stats().as_dict()
    assert stats["prefix_cache"]["hits"] > 0
    if flags.get("cuda_graphs"):
        assert stats["capture"]["replays"] > 0
