"""Automatic prefix caching against the engine without it: the same bytes, fewer computed tokens, a pool whose
audit holds after every step, and a cache that never serves content it does not hold."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import StepFailed
from nanoserve.errors import RequestError
from tests.test_engine_crowd import BLOCK_BYTES

SYSTEM = "You are a helpful assistant. Answer briefly and truthfully. " * 3  # several blocks of shared prefix
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=seed, max_tokens=12, ignore_eos=True)


def crowd(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing prefixes of every kind: none, part of a block, exactly k blocks, the whole prompt."""
    base = tokenizer.encode(SYSTEM)
    k_blocks = base[: (len(base) // 16) * 16]
    return [
        (base + tokenizer.encode(" What is two plus two?"), GREEDY),
        (base + tokenizer.encode(" Name a colour."), seeded(1)),
        (k_blocks, GREEDY),  # exactly k blocks: the whole prompt cached but its last block
        (k_blocks + tokenizer.encode(" and more"), seeded(2)),
        (base[:9] + tokenizer.encode(" unrelated tail text"), GREEDY),  # part of one block only
        (tokenizer.encode("Nothing shared at all here."), seeded(3)),
        (base + tokenizer.encode(" What is two plus two?"), GREEDY),  # the whole prompt again
        (base + tokenizer.encode(" What is two plus two?"), seeded(4)),
    ]


def make(ckpt, caching: bool, **flags) -> LLM:
    return LLM(model=str(ckpt), enable_prefix_caching=caching, **{"max_model_len": 256, "kv_cache_gib": 0.01, **flags})


def run_audited(llm: LLM, prompts) -> dict[str, list[int]]:
    """Add the crowd in waves (so later prompts find earlier ones cached) and audit after every step."""
    engine, out = llm.engine, {}
    for wave in (prompts[:3], prompts[3:]):
        for i, (ids, params) in enumerate(wave, start=len(out)):
            engine.add_request(ids, params, request_id=f"r{prompts.index((ids, params))}-{i}")
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            engine.audit()
    return out


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def cold(ckpt):
    llm = make(ckpt, caching=False)
    return run_audited(llm, crowd(llm.engine.tokenizer))


@pytest.mark.parametrize("flags", [
    {},
    {"kv_cache_gib": 10 * BLOCK_BYTES / 2**30, "max_model_len": 144},  # small: evicts and preempts
    {"decode_buckets": True, "persistent_inputs": True, "row_compaction": True},
    {"streamed_read": True, "batch_invariant": False},
    {"max_num_batched_tokens": 24, "max_num_seqs": 4},  # chunked prefill from cached blocks
], ids=["plain", "small-pool", "fast-path", "streamed", "chunked"])
def test_outputs_equal_the_engine_without_caching(ckpt, cold, flags):
    llm = make(ckpt, caching=True, **flags)
    warm = run_audited(llm, crowd(llm.engine.tokenizer))
    assert warm == cold
    cache = llm.engine.stats().prefix_cache
    assert cache.enabled and cache.hits > 0 and cache.queries > cache.hits
    if "max_model_len" in flags:
        assert cache.evictions > 0 and llm.engine.stats().scheduler.preemptions > 0


def test_a_cached_prompt_computes_only_its_tail_and_its_logprobs_equal_a_cold_run(ckpt):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    cold = make(ckpt, caching=False).generate([SYSTEM + " Why?"], params)[0]
    llm = make(ckpt, caching=True)
    llm.generate([SYSTEM + " How?"], params)
    warm = llm.generate([SYSTEM + " Why?"], params)[0]
    prompt_len = len(warm.prompt_token_ids)
    cached = llm.engine.stats().prefix_cache.hits
    assert 16 <= cached < prompt_len and cached % 16 == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for w, c in zip(warm.outputs[0].logprobs.entries(), cold.outputs[0].logprobs.entries()):
        assert dict(w.top).keys() == dict(c.top).keys()
        assert max(abs(a - dict(c.top)[t]) for t, a in w.top) < 1e-4


def test_the_whole_prompt_cached_still_computes_its_last_token(ckpt):
    llm = make(ckpt, caching=True)
    ids = llm.engine.tokenizer.encode(SYSTEM)[:32]  # exactly two blocks
    llm.generate([ids], GREEDY)
    engine = llm.engine
    engine.add_request(ids, GREEDY, request_id="again")
    (req,) = engine.sequences("again")
    sched = engine.scheduler.schedule()
    assert req.num_cached_tokens == 16 and sched.prefills[0].length == 16  # one block reused, one computed
    engine.kv.free(req, finished=True)  # undo the hand-scheduled step: this test only reads the plan


def test_same_step_arrivals_share_blocks_instead_of_allocating_twice(ckpt):
    llm = make(ckpt, caching=True)
    engine = llm.engine
    ids = engine.tokenizer.encode(SYSTEM)[:40]
    engine.add_request(ids, GREEDY, request_id="a")
    engine.add_request(ids, GREEDY, request_id="b")
    engine.step()  # both admitted in this one step
    (a,), (b,) = engine.sequences("a"), engine.sequences("b")
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert engine.kv.num_used == 4  # two shared full blocks, and each one's partial third
    engine.audit()
    while engine.has_unfinished():
        engine.step()
    solo = make(ckpt, caching=False).generate([ids], GREEDY)[0].outputs[0].token_ids
    assert engine.stats().scheduler.finished == {"length": 2}
    assert llm.generate([ids], GREEDY)[0].outputs[0].token_ids == solo


def test_n_completions_share_their_prompt_blocks(ckpt):
    llm = make(ckpt, caching=True)
    engine = llm.engine
    engine.add_request(SYSTEM, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=4), request_id="n3")
    engine.step()
    seqs = engine.sequences("n3")
    assert len({tuple(s.blocks[:2]) for s in seqs}) == 1  # one copy of the shared full blocks
    assert engine.stats().prefix_cache.hits > 0


def test_a_colliding_hash_never_reuses_a_block_whose_content_differs(ckpt, cold):
    llm = make(ckpt, caching=True)
    llm.engine.kv.hash_fn = lambda parent, tokens: b"every block has this name"
    warm = run_audited(llm, crowd(llm.engine.tokenizer))
    assert warm == cold
    assert llm.engine.stats().prefix_cache.hits > 0  # the one name still serves the prefix it really holds


def test_a_failed_step_leaves_no_names_for_content_it_never_wrote(ckpt):
    llm = make(ckpt, caching=True)
    engine = llm.engine
    real = engine.runner.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    engine.runner.model.forward = broken
    engine.add_request(SYSTEM, GREEDY, request_id="doomed")
    with pytest.raises(StepFailed):
        engine.step()
    engine.runner.model.forward = real
    assert engine.stats().prefix_cache.cached_blocks == 0
    out = llm.generate([SYSTEM], GREEDY)[0]
    assert engine.stats().prefix_cache.hits == 0
    assert out.outputs[0].token_ids == make(ckpt, caching=False).generate([SYSTEM], GREEDY)[0].outputs[0].token_ids


def test_reset_forgets_and_a_new_engine_starts_empty(ckpt):
    llm = make(ckpt, caching=True)
    llm.generate([SYSTEM], GREEDY)
    assert llm.engine.stats().prefix_cache.cached_blocks > 0
    assert llm.engine.reset_prefix_cache() > 0
    llm.generate([SYSTEM], GREEDY)
    assert llm.engine.stats().prefix_cache.hits == 0
    fresh = make(ckpt, caching=True).engine.stats().prefix_cache
    assert (fresh.cached_blocks, fresh.hits, fresh.queries) == (0, 0, 0)


def test_prompt_logprobs_requests_compute_every_position(ckpt):
    llm = make(ckpt, caching=True)
    llm.generate([SYSTEM], GREEDY)
    with_lp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([SYSTEM], with_lp)[0]
    assert all(e is not None for e in out.prompt_logprobs.entries()[1:])
    assert llm.engine.stats().prefix_cache.hits == 0


def test_off_means_off(ckpt):
    llm = make(ckpt, caching=False)
    llm.generate([SYSTEM, SYSTEM], GREEDY)
    cache = llm.engine.stats().prefix_cache
    assert not cache.enabled and (cache.queries, cache.hits, cache.cached_blocks) == (0, 0, 0)


def test_usage_reports_cached_tokens_and_reset_is_an_operator_route(ckpt):
    import httpx

    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    s = Server(EngineConfig(model=str(ckpt), max_model_len=256, kv_cache_gib=0.01), port=0, api_key="k",
               prompt_tokens_details=True).start()
    auth = {"Authorization": "Bearer k"}
    try:
        body = {"prompt": SYSTEM, "max_tokens": 2}
        first = httpx.post(s.url + "/v1/completions", json=body, headers=auth).json()["usage"]
        second = httpx.post(s.url + "/v1/completions", json=body, headers=auth).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16 > 0
        chat = {"messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        for _ in range(2):
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=chat, headers=auth) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: {")]
        import json

        assert json.loads(events[-1][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 401
        reset = httpx.post(s.url + "/reset_prefix_cache", headers=auth)
        assert reset.status_code == 200 and reset.json()["blocks_forgotten"] > 0
        again = httpx.post(s.url + "/v1/completions", json=body, headers=auth).json()["usage"]
        assert again["prompt_tokens_details"] == {"cached_tokens": 0}
        health = httpx.get(s.url + "/health", headers=auth).json()["prefix_cache"]  # the snapshot wants the key
        assert health["enabled"] and health["hits"] > 0 and 0 < health["hit_rate"] < 1
        metrics = httpx.get(s.url + "/metrics").text
        assert "nanoserve:prefix_cache_hits_total" in metrics and "nanoserve:prefix_cache_queries_total" in metrics
    finally:
        s.stop()


def test_a_preempted_request_finds_its_own_blocks_again(ckpt):
    """Distinct prompts share nothing, so every hit here is a preempted request re-finding its own blocks."""
    flags = {"kv_cache_gib": 10 * BLOCK_BYTES / 2**30, "max_model_len": 144}
    prompts = [f"{word} " * 20 for word in ("alpha", "beta", "gamma", "delta")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = make(ckpt, caching=True, **flags)
    warm = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats.scheduler.preemptions > 0 and stats.prefix_cache.hits > 0
    cold = make(ckpt, caching=False, **flags).generate(prompts, params)
    assert [w.outputs[0].token_ids for w in warm] == [c.outputs[0].token_ids for c in cold]


@pytest.mark.parametrize("colliding", [False, True], ids=["sha256", "colliding-hash"])
def test_a_cache_salt_shares_blocks_only_within_the_salt(ckpt, colliding):
    """vLLM's cache_salt: a tenant's salt keeps its cached blocks from every other salt (and from unsalted
    requests), even under a hash that names every block alike."""
    llm = make(ckpt, caching=True)
    if colliding:
        llm.engine.kv.hash_fn = lambda parent, tokens: b"every block has this name"
    hits = lambda: llm.engine.stats().prefix_cache.hits  # noqa: E731
    llm.generate([{"prompt": SYSTEM, "cache_salt": "tenant-a"}], GREEDY)
    for other in ({"prompt": SYSTEM}, {"prompt": SYSTEM, "cache_salt": "tenant-b"}):
        llm.generate([other], GREEDY)
        assert hits() == 0
    before = hits()
    out = llm.generate([{"prompt": SYSTEM, "cache_salt": "tenant-a"}], GREEDY)[0]
    assert hits() > before and out.num_cached_tokens > 0
    llm.engine.audit()
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt": SYSTEM, "cache_salt": ""}], GREEDY)


def test_the_server_honours_cache_salt(ckpt):
    import httpx

    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    s = Server(EngineConfig(model=str(ckpt), max_model_len=256, kv_cache_gib=0.01), port=0, prompt_tokens_details=True).start()
    try:
        def cached(salt):
            body = {"prompt": SYSTEM, "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
            r = httpx.post(s.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached("a"), cached("b"), cached(None), cached("a")][:3] == [0, 0, 0]
        assert cached("b") > 0
        chat = {"messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 2, "cache_salt": ""}
        refused = httpx.post(s.url + "/v1/chat/completions", json=chat)
        assert refused.status_code == 400 and "cache_salt" in refused.text
    finally:
        s.stop()
