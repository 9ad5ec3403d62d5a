"""The live HTTP server on loopback, driven by the official openai client and raw httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from nanoserve import EngineConfig, SamplingParams
from nanoserve.server.serve import Server

from .helpers import wait_until


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def offline(tiny_offline):
    return tiny_offline


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)



def health(server):
    return httpx.get(server.url + "/health").json()


GREEDY = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
SEEDED = dict(temperature=0.9, seed=11, max_tokens=16, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("kw", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completion_streamed_equals_unstreamed_equals_offline(client, offline, kw):
    plain = client.completions.create(model="tiny", prompt="Once upon a time", **kw)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", stream=True, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    params = SamplingParams(temperature=kw["temperature"], seed=kw.get("seed"), max_tokens=16, ignore_eos=True)
    expected = offline.generate(["Once upon a time"], params)[0].outputs[0].text
    assert plain.choices[0].text == streamed == expected
    assert plain.choices[0].finish_reason == "length" and chunks[-1].choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 16


@pytest.mark.parametrize("kw", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chat_streamed_equals_unstreamed_equals_offline(client, offline, kw):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, **kw)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    params = SamplingParams(temperature=kw["temperature"], seed=kw.get("seed"), max_tokens=16, ignore_eos=True)
    expected = offline.chat(messages, params)[0].outputs[0].text
    assert plain.choices[0].message.content == streamed == expected
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = health(server)
    assert h["status"] == "ok" and h["paged_read"]["mode"] == "gathered"
    assert {"running", "waiting", "peak_running", "preemptions"} <= set(h["scheduler"])
    assert {"blocks_total", "blocks_free", "blocks_used", "usage"} <= set(h["kv"])
    assert h["flags"]["max_model_len"] == 128


def test_metrics_use_vllm_names(client, server):
    client.completions.create(model="tiny", prompt="hi", **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"nanoserve:{name}" in text, name
    assert 'finished_reason="length"' in text


def test_the_metrics_routers_scrape_carry_vllms_names_types_and_labels(client, server):
    """llm-d and the Gateway API Inference Extension pick an endpoint by vLLM's own metric names."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt="hi", **GREEDY)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    stats = health(server)
    for name, want in (("vllm:num_requests_running", stats["scheduler"]["running"]),
                       ("vllm:num_requests_waiting", stats["scheduler"]["waiting"]),
                       ("vllm:kv_cache_usage_perc", stats["kv"]["usage"])):
        (sample,) = families[name].samples
        assert families[name].type == "gauge" and sample.labels == {"model_name": "tiny", "engine": "0"}
        assert sample.value == want, name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["model_name"] == "tiny"
    assert int(info.labels["block_size"]) == stats["kv"]["block_size"]
    assert int(info.labels["num_gpu_blocks"]) == stats["kv"]["blocks_total"]
    assert info.labels["enable_prefix_caching"] == "True"


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "tiny", "prompt": "x " * 300, "max_tokens": 4}, 400, "max_model_len"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "n": 500}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "suffix": "!"}, 400, "suffix is not supported"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
    ({"model": "tiny", "prompt": [10**9]}, 400, "vocabulary"),
    ({"model": "other", "prompt": "hi"}, 404, "not served"),
])
def test_bad_completion_bodies_are_4xx_with_an_error_body(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and {"message", "type", "param", "code"} <= set(err)


@pytest.mark.parametrize("body,needle", [
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "", "content": "hi"}]}, "role"),  # any other role: the template's
    ({"model": "tiny"}, "messages"),
])
def test_bad_chat_bodies_are_400(server, body, needle):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_malformed_json_and_oversized_body(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    before = health(server)["scheduler"]["prompt_tokens_total"]
    big = json.dumps({"model": "tiny", "prompt": "word " * 2**20, "max_tokens": 1}).encode()  # valid, 5 MiB
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and f"{len(big)} bytes" in r.json()["error"]["message"]
    assert health(server)["scheduler"]["prompt_tokens_total"] == before  # never parsed, never admitted


def test_disconnect_mid_stream_returns_blocks(server):
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "temperature": 0}
    before = health(server)["scheduler"]["finished"].get("abort", 0)
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    assert wait_until(lambda: health(server)["scheduler"]["finished"].get("abort", 0) == before + 1)
    h = health(server)
    assert h["kv"]["blocks_free"] == h["kv"]["blocks_total"] and h["scheduler"]["running"] == 0


def test_crowd_of_streams_equals_solo_runs(server, offline):
    prompts = [f"Story number {i}:" for i in range(6)]

    async def one(http, prompt, seed):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "ignore_eos": True, "stream": True,
                "temperature": 0.8 if seed else 0, "seed": seed}
        text = ""
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"] if json.loads(line[6:])["choices"] else ""
        return text

    async def crowd():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, p, i % 2 and i) for i, p in enumerate(prompts)))

    texts = asyncio.run(crowd())
    for i, (p, t) in enumerate(zip(prompts, texts)):
        seed = i % 2 and i
        params = SamplingParams(temperature=0.8 if seed else 0, seed=seed or None, max_tokens=20, ignore_eos=True)
        assert t == offline.generate([p], params)[0].outputs[0].text
    assert health(server)["scheduler"]["peak_running"] >= 2


def test_api_key_is_required_when_set(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    s = Server(config, port=0, api_key="sekrit").start()
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def _admission_rejections(s) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
    return {x.labels["reason"]: x.value for x in families["vllm:admission_rejections"].samples
            if x.name == "vllm:admission_rejections_total"}


def test_full_waiting_queue_is_503_and_the_server_recovers(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01,
                          max_num_seqs=1, max_num_batched_tokens=16)
    s = Server(config, port=0, max_waiting=1).start()
    body = {"prompt": "a long story", "max_tokens": 100, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as running, \
                httpx.stream("POST", s.url + "/v1/completions", json=body):
            assert running.status_code == 200
            assert _admission_rejections(s) == {"max_waiting": 0}
            assert wait_until(lambda: health(s)["scheduler"]["waiting"] == 1), health(s)["scheduler"]
            full = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert full.status_code == 503 and "queue is full" in full.json()["error"]["message"]
            assert _admission_rejections(s) == {"max_waiting": 1}  # vLLM's counter, labelled with our limit
        assert wait_until(lambda: health(s)["scheduler"]["running"] == 0 and health(s)["scheduler"]["waiting"] == 0)
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        h = health(s)
        assert h["kv"]["blocks_free"] == h["kv"]["blocks_total"]
    finally:
        s.stop()


def test_logprobs_through_both_routes(client, offline):
    plain = client.completions.create(model="tiny", prompt="Hello", logprobs=2, **GREEDY)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = offline.generate(["Hello"], params)[0].outputs[0]
    assert [round(x, 4) for x in lp.token_logprobs] == [round(e[t].logprob, 4) for t, e in zip(ref.token_ids,
                                                                                                ref.logprobs)]
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(content) == len(ref.logprobs) == 16
    for served, token, position in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert (served.token, round(served.logprob, 4)) == (position[token].decoded_token,
                                                            round(position[token].logprob, 4))
        top = sorted(position.values(), key=lambda lp: lp.rank)[:3]  # the sampled token may sit outside them
        assert [(t.token, round(t.logprob, 4)) for t in served.top_logprobs] == \
            [(lp.decoded_token, round(lp.logprob, 4)) for lp in top]


def test_stop_strings_through_the_api(server, offline):
    base = offline.generate(["The"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    body = {"prompt": "The", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    cut = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    kept = httpx.post(server.url + "/v1/completions",
                      json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    assert kept["text"] == text[: text.index(stop)] + stop
