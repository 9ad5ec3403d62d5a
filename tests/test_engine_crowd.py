"""Continuous batching against solo runs: a crowd's outputs equal each request run alone."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams

MIXED = [
    ("Once upon a time", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    ("The capital of France is", SamplingParams(temperature=0.8, seed=7, max_tokens=33, ignore_eos=True)),
    ("1, 2, 3, 4,", SamplingParams(temperature=1.0, top_k=20, seed=1, max_tokens=25, ignore_eos=True)),
    ("A long prompt " * 30, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)),
    ("Hello", SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=50, ignore_eos=True)),
    ("import torch\n", SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True)),
    ("Q: why? A:", SamplingParams(temperature=1.2, min_p=0.05, seed=11, presence_penalty=0.5,
                                  frequency_penalty=0.3, max_tokens=36, ignore_eos=True)),
    ("x " * 70, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3)),
    ("Tell me a story about a dragon", SamplingParams(temperature=0.9, seed=5, max_tokens=44, ignore_eos=True)),
    ("Z", SamplingParams(temperature=0, max_tokens=21, min_tokens=5)),
]


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32


def make(path, **flags):
    return LLM(model=str(path), max_model_len=256, **{"kv_cache_gib": 0.01, **flags})


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def solo(ckpt):
    llm = make(ckpt)
    return [llm.generate([p], s)[0] for p, s in MIXED]


def assert_same(crowd, solo):
    for c, s in zip(crowd, solo):
        assert c.outputs[0].token_ids == s.outputs[0].token_ids, c.request_id
        assert c.outputs[0].text == s.outputs[0].text
        assert c.outputs[0].finish_reason == s.outputs[0].finish_reason


def test_crowd_equals_solo(ckpt, solo):
    llm = make(ckpt)
    crowd = llm.generate([p for p, _ in MIXED], [s for _, s in MIXED])
    assert llm.engine.stats().scheduler.peak_running == len(MIXED)
    assert_same(crowd, solo)
    llm.engine.audit()
    assert llm.engine.kv.num_free == llm.engine.kv.num_usable


def test_crowd_with_preemption_equals_solo(ckpt, solo):
    # 17 blocks of 16 tokens (one is the null block): just one max_model_len sequence, far less than the
    # crowd needs at once, so rows are preempted and recomputed.
    llm = make(ckpt, kv_cache_gib=17 * BLOCK_BYTES / 2**30, max_num_seqs=10)
    assert llm.engine.kv.num_usable == 16
    crowd = llm.generate([p for p, _ in MIXED], [s for _, s in MIXED])
    stats = llm.engine.stats()
    assert stats.scheduler.preemptions > 0
    assert_same(crowd, solo)
    llm.engine.audit()
    assert stats.kv.blocks_free == stats.kv.blocks_total


def test_chunked_prefill_equals_solo(ckpt, solo):
    llm = make(ckpt, max_num_batched_tokens=24, max_num_seqs=8)
    crowd = llm.generate([p for p, _ in MIXED], [s for _, s in MIXED])
    assert_same(crowd, solo)
    llm.engine.audit()


def test_arrivals_mid_run_equal_solo(ckpt, solo):
    """Requests that arrive while others decode join the batch and still match their solo runs."""
    llm = make(ckpt)
    engine = llm.engine
    done = {}
    pending = list(enumerate(MIXED))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            i, (p, s) = pending.pop(0)
            engine.add_request(p, s, request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        steps += 1
        engine.audit()
    assert_same([done[i] for i in range(len(MIXED))], solo)


def test_streamed_deltas_add_up_to_the_final_text(ckpt):
    llm = make(ckpt)
    engine = llm.engine
    for i, (p, s) in enumerate(MIXED):
        engine.add_request(p, s, request_id=str(i))
    text = {str(i): "" for i in range(len(MIXED))}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] += out.delta_text
            if out.finished:
                final[out.request_id] = out.outputs[0].text
    assert text == final


def test_logprobs_returned_when_asked(solo):
    out = solo[7].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):  # vLLM's shape: {token id: Logprob}, the sampled token first
        assert next(iter(lp)) == tok and len(lp) in (3, 4) and lp[tok].logprob <= 0
        assert {1, 2, 3} <= {x.rank for x in lp.values()}
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    assert solo[0].outputs[0].logprobs is None and solo[0].outputs[0].cumulative_logprob is None
