"""A client that leaves a non-streamed request takes its work with it: the request is aborted, its blocks return."""

from __future__ import annotations

import time

import httpx
import pytest

from nanoserve import EngineConfig
from nanoserve.server.serve import Server

from .helpers import wait_until

STEP_SECONDS = 0.01  # each engine step slowed, so a 400-token answer takes 4 s and the client leaves long before


@pytest.fixture(scope="module")
def slow_server(tiny_checkpoint):
    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_gib=0.01), port=0,
               served_model_name="tiny").start()
    engine = s.host.engine
    real_step = engine.step

    def slow_step():
        time.sleep(STEP_SECONDS)
        return real_step()

    engine.step = slow_step
    yield s
    s.stop()


def health(server):
    return httpx.get(server.url + "/health").json()


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "a long story"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a long story"}]}),
])
def test_a_client_that_times_out_aborts_its_non_streamed_request(slow_server, route, body):
    body = {"model": "tiny", "max_tokens": 400, "ignore_eos": True, "temperature": 0, **body}
    before = health(slow_server)["scheduler"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + route, json=body, timeout=0.5)
    # without the watch the request ran to its 400th token (about 4 s) and finished as "length"
    assert wait_until(lambda: health(slow_server)["scheduler"]["finished"].get("abort", 0)
                      == before["finished"].get("abort", 0) + 1, timeout=3)
    after = health(slow_server)
    assert after["scheduler"]["running"] == 0 and after["kv"]["blocks_free"] == after["kv"]["blocks_total"]
    assert after["scheduler"]["finished"].get("length", 0) == before["finished"].get("length", 0)
    assert after["scheduler"]["generation_tokens_total"] - before["generation_tokens_total"] < 200


def test_a_client_that_waits_gets_its_whole_answer(slow_server):
    body = {"model": "tiny", "prompt": "short", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    r = httpx.post(slow_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
