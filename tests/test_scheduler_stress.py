"""Random arrivals, aborts and a pool too small for the crowd: the pool audits clean after every step."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_keeps_the_pool_consistent(tiny_checkpoint, seed):
    rng = random.Random(seed)
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=12 * BLOCK_BYTES / 2**30,
              max_num_seqs=6, max_num_batched_tokens=48)
    engine = llm.engine
    assert engine.kv.num_usable == 11
    live, finished, wanted = set(), {}, {}
    for _ in range(150):
        if rng.random() < 0.35:
            prompt = [rng.randrange(100, 4000) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(temperature=rng.choice([0, 0.9]), seed=rng.randrange(99),
                                    max_tokens=rng.randint(1, 128 - len(prompt)), ignore_eos=True)
            rid = engine.add_request(prompt, params)
            live.add(rid)
            wanted[rid] = params.max_tokens
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
                live.discard(out.request_id)
        engine.audit()
        assert len(engine.scheduler.running) <= 6
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                live.discard(out.request_id)
        engine.audit()
    assert not live
    assert engine.kv.num_free == engine.kv.num_usable
    assert set(finished) == set(wanted)
    for rid, out in finished.items():
        c = out.outputs[0]
        assert c.finish_reason in ("length", "abort")
        if c.finish_reason == "length":
            assert len(c.token_ids) == wanted[rid]
        else:
            assert len(c.token_ids) <= wanted[rid]
    stats = engine.stats().scheduler
    assert stats.preemptions > 0, "the pool should have been too small for this traffic"
    assert sum(stats.finished.values()) == len(finished)


def test_decodes_are_never_starved_by_arriving_prompts(tiny_checkpoint):
    """Policy: every running decode row gets its token each step, whatever prefill work is waiting."""
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01,
              max_num_seqs=8, max_num_batched_tokens=32)
    engine = llm.engine
    rid = engine.add_request("the decoding row", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not engine.sequences(rid)[0].output_ids:
        engine.step()
    for i in range(7):  # a burst of long prompts: each needs several 32-token chunks
        engine.add_request([100 + i] * 150, SamplingParams(max_tokens=4, ignore_eos=True))
    before = len(engine.sequences(rid)[0].output_ids)
    for n in range(1, 12):
        outs = engine.step()
        assert any(o.request_id == rid for o in outs), f"the decode row got no token in step {n}"
        assert len(engine.sequences(rid)[0].output_ids) == before + n
    while engine.has_unfinished():
        engine.step()
    engine.audit()
