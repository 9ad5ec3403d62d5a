"""EngineHost: the engine thread and per-request async streams, against the offline API as oracle."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine import Engine
from nanoserve.errors import RequestError
from nanoserve.server.host import EngineHost, HostStopped

from .helpers import wait_until

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Hello"]


def engine_for(path) -> Engine:
    return LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01).engine


@pytest.fixture
def host(tiny_checkpoint):
    h = EngineHost(engine_for(tiny_checkpoint("llama"))).start()
    yield h
    h.shutdown()


async def collect(host, prompt, params):
    text, last = "", None
    async for out in host.generate(prompt, params):
        text += out.delta_text
        last = out
    return text, last



async def test_concurrent_streams_equal_offline_runs(host, tiny_checkpoint):
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=25, ignore_eos=True)] * 2
    results = await asyncio.gather(*(collect(host, p, s) for p, s in zip(PROMPTS, params)))
    offline = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    expected = offline.generate(PROMPTS, params)
    for (text, last), exp in zip(results, expected):
        assert last.finished and last.outputs[0].token_ids == exp.outputs[0].token_ids
        assert text == exp.outputs[0].text == last.outputs[0].text
    assert host.stats().scheduler.peak_running >= 2


async def test_refused_request_raises_and_holds_nothing(host):
    with pytest.raises(RequestError, match="max_model_len"):
        await collect(host, "x " * 300, SamplingParams(max_tokens=4))
    text, last = await collect(host, "still serving", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert last.outputs[0].finish_reason == "length"
    assert wait_until(lambda: host.stats().kv.blocks_free == host.stats().kv.blocks_total)


async def test_consumer_that_leaves_aborts_its_request_and_frees_blocks(host):
    stream = host.generate("a long story " * 5, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    assert wait_until(lambda: host.stats().scheduler.finished.get("abort", 0) == 1)
    stats = host.stats()
    assert stats.kv.blocks_free == stats.kv.blocks_total and stats.scheduler.running == 0


def test_shutdown_without_drain_aborts_and_with_drain_finishes(tiny_checkpoint):
    outputs = {"abort": [], "drain": []}
    for mode in outputs:
        host = EngineHost(engine_for(tiny_checkpoint("llama"))).start()
        host.submit("keep going " * 3, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                    outputs[mode].append)
        assert wait_until(lambda: host.stats().scheduler.running == 1)  # noqa: B023
        host.shutdown(drain=(mode == "drain"))
        assert outputs[mode][-1].finished
        with pytest.raises(HostStopped):
            host.submit("late", SamplingParams(), lambda _: None)
        host.engine.audit()
    assert outputs["abort"][-1].outputs[0].finish_reason == "abort"
    assert outputs["drain"][-1].outputs[0].finish_reason == "length"
    assert len(outputs["drain"][-1].outputs[0].token_ids) == 60


async def test_restart_with_new_flags_keeps_serving(tiny_checkpoint):
    from nanoserve import EngineConfig
    from nanoserve.errors import ConfigError

    host = EngineHost(engine_for(tiny_checkpoint("llama"))).start()
    try:
        before = await collect(host, "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=96, kv_cache_gib=0.01,
                              max_num_seqs=3)
        await asyncio.get_running_loop().run_in_executor(None, host.restart, config)
        assert host.stats().flags["max_num_seqs"] == 3 and host.stats().max_model_len == 96
        after = await collect(host, "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert after[0] == before[0]
        bad = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=4096, kv_cache_gib=0.01)
        with pytest.raises(ConfigError):
            await asyncio.get_running_loop().run_in_executor(None, host.restart, bad)
        assert host.running and host.stats().max_model_len == 96  # the previous flags are back
        again = await collect(host, "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert again[0] == before[0]
    finally:
        host.shutdown()


async def test_a_stop_ends_every_sequence_of_a_request_with_n_above_one(tiny_checkpoint):
    """A stop aborts what runs; a request of n = 2 has an output per sequence and only the last is `finished`.
    (The stop used to hand the request's first aborted output over and forget it, so its client, waiting for
    the second, hung forever; the soak found it at its mid-run restart.)"""
    host = EngineHost(engine_for(tiny_checkpoint("llama"))).start()
    stream = await host.open("a long story", SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=100,
                                                             ignore_eos=True))
    first = await stream.__anext__()
    await asyncio.to_thread(host.shutdown)
    async def rest():
        return [out async for out in stream]

    outs = [first] + await asyncio.wait_for(rest(), 10)  # it ends: the last output is `finished`
    assert outs[-1].finished and {o.outputs[0].index for o in outs} == {0, 1}
    assert {o.outputs[0].finish_reason for o in outs[-2:]} == {"abort"}
    assert host.accounting() == {"admitted": 1, "ended": 1, "live": 0, "dropped": 0}
