"""Faults inside the engine stay inside the requests they touch: a model whose forward raises on a chosen token
ends only the requests of that step, each with an OpenAI-shaped error (a final SSE error event and [DONE] when
streamed), their blocks return, the engine serves on, and failures that repeat make /health say so."""

from __future__ import annotations

import json

import httpx
import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.engine import StepFailed
from nanoserve.server.serve import Server

from .helpers import wait_until

GREEDY = {"temperature": 0, "ignore_eos": True}


class Poison:
    """Wraps a model's forward: a step whose input ids include `token` raises, as a kernel fault would."""

    def __init__(self, model):
        self.model, self.real, self.token, self.hits = model, model.forward, None, 0
        model.forward = self

    def __call__(self, batch, *args, **kwargs):
        if self.token is not None and bool((batch.input_ids == self.token).any()):
            self.hits += 1
            raise RuntimeError(f"injected fault on token {self.token}")
        return self.real(batch, *args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01), port=0,
               served_model_name="tiny").start()
    poison = Poison(s.host.engine.runner.model)
    yield s, poison
    s.stop()


@pytest.fixture
def server(served):
    s, poison = served
    poison.token = None
    s.host.failures.__init__()  # each test starts with a clean failure record
    yield s, poison
    poison.token = None


def health(server) -> httpx.Response:
    return httpx.get(server.url + "/health")


def all_blocks_free(server) -> bool:
    kv = health(server).json()["kv"]
    return kv["blocks_free"] == kv["blocks_total"]


def generated_ids(server, prompt: str, n: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, "logprobs": 0, "return_tokens_as_token_ids": True, **GREEDY}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def prompt_ids(server, prompt: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]


def a_fresh_token(server, prompt: str, at_least: int = 2) -> int:
    """A token the model generates for `prompt` (greedy) at position >= at_least that appears nowhere before."""
    seen, out = set(prompt_ids(server, prompt)), generated_ids(server, prompt, 12)
    for i, t in enumerate(out):
        if i >= at_least and t not in seen:
            return t
        seen.add(t)
    pytest.fail("the tiny model repeats itself on this prompt: choose another prompt, or this test checks nothing")


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}]}),
])
def test_a_failed_step_is_an_openai_error_and_the_engine_serves_on(server, route, body):
    s, poison = server
    poison.token = prompt_ids(s, "Once upon a time")[-1]  # the prompt's own token: its prefill fails
    r = httpx.post(s.url + route, json={**body, "max_tokens": 8, **GREEDY}, timeout=30)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert poison.hits >= 1 and wait_until(lambda: all_blocks_free(s))
    assert health(s).status_code == 200  # one failure is contained, not a sick server
    ok = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, **GREEDY})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "The capital of France is"}]}),
])
def test_a_stream_that_fails_mid_way_ends_with_an_error_event_and_done(server, route, body):
    s, poison = server
    if route == "/v1/completions":
        trigger = a_fresh_token(s, body["prompt"])
    else:  # the chat prompt is templated: find its generated tokens through the chat route itself
        r = httpx.post(s.url + route, json={**body, "max_tokens": 12, "logprobs": True, **GREEDY})
        content = r.json()["choices"][0]["logprobs"]["content"]
        ids = prompt_ids(s, "".join(c["token"] for c in content))
        trigger = next((t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i]), None)
        if trigger is None:
            pytest.fail("the tiny model repeats itself on this prompt: choose another prompt, or this test checks "
                        "nothing")
    poison.token = trigger
    events = []
    with httpx.stream("POST", s.url + route, json={**body, "max_tokens": 12, "stream": True, **GREEDY},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "server_error" and "injected fault" in last["error"]["message"]
    assert len(events) >= 3  # something was streamed before the fault
    assert wait_until(lambda: all_blocks_free(s))


def test_failures_that_repeat_make_health_unhealthy_with_the_reason(server):
    s, poison = server
    poison.token = prompt_ids(s, "Hello")[-1]
    for _ in range(3):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 500
    h = health(s)
    assert h.status_code == 503
    assert h.json()["status"] == "unhealthy" and "injected fault" in h.json()["reason"]
    assert h.json()["failed_steps_total"] == 3


def test_the_open_health_probe_says_unhealthy_without_the_failures_text(tiny_checkpoint):
    """A failure's text may quote the request that met it: behind a key, a caller without it reads the status
    and the count, never the text."""
    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01), port=0,
               api_key="k3y", served_model_name="tiny").start()
    try:
        poison = Poison(s.host.engine.runner.model)
        poison.token = httpx.post(s.url + "/tokenize", json={"prompt": "Hello"},
                                  headers={"Authorization": "Bearer k3y"}).json()["tokens"][-1]
        for _ in range(3):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                           headers={"Authorization": "Bearer k3y"})
            assert r.status_code == 500
        open_probe = httpx.get(s.url + "/health")
        assert open_probe.status_code == 503 and open_probe.json()["status"] == "unhealthy"
        assert "3 engine steps failed" in open_probe.json()["reason"]
        assert "injected fault" not in open_probe.text
        keyed = httpx.get(s.url + "/health", headers={"Authorization": "Bearer k3y"})
        assert "injected fault" in keyed.json()["reason"]
    finally:
        s.stop()


def test_a_sink_that_raises_loses_only_its_own_request(tiny_checkpoint):
    from nanoserve.server.host import EngineHost

    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    host = EngineHost(engine).start()
    try:
        got = []

        def broken(item):
            raise ValueError("the consumer broke")

        params = SamplingParams(max_tokens=6, **GREEDY)
        host.submit("first", params, broken)
        host.submit("second", params, got.append)
        assert wait_until(lambda: got and got[-1].finished)
        assert host.running and got[-1].outputs[0].finish_reason == "length"
        assert wait_until(lambda: host.stats().kv.blocks_free == host.stats().kv.blocks_total)
        assert host.stats().scheduler.finished.get("abort") == 1  # the broken one, aborted at its first output
    finally:
        host.shutdown()


def test_a_failure_outside_the_step_ends_every_request_and_the_host_serves_on(tiny_checkpoint):
    from nanoserve.server.host import EngineFailure, EngineHost

    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    host = EngineHost(engine).start()
    real, calls = engine.scheduler.schedule, []

    def schedule_once_broken():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return real()

    engine.scheduler.schedule = schedule_once_broken
    try:
        got = []
        host.submit("doomed", SamplingParams(max_tokens=20, **GREEDY), got.append)
        assert wait_until(lambda: got and isinstance(got[-1], EngineFailure))
        assert "scheduler bug" in str(got[-1]) and host.running
        after = []
        host.submit("after", SamplingParams(max_tokens=3, **GREEDY), after.append)
        assert wait_until(lambda: after and not isinstance(after[-1], Exception) and after[-1].finished)
        assert wait_until(lambda: host.stats().kv.blocks_free == host.stats().kv.blocks_total)
    finally:
        host.shutdown()


def test_offline_a_failed_step_raises_and_leaves_the_engine_sound(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    engine, poison = llm.engine, Poison(llm.engine.runner.model)
    poison.token = engine.tokenizer.encode("Hello")[-1]
    engine.add_request("Hello", SamplingParams(max_tokens=4, **GREEDY), request_id="bad")
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["bad"] and not engine.has_unfinished()
    engine.audit()
    assert engine.kv.num_free == engine.kv.num_usable
    assert engine.stats().scheduler.finished == {"error": 1}
    poison.token = None
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.outputs[0].finish_reason == "length"
