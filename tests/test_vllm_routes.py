"""vLLM's server behaviour that its own server tests hold, each against a live server driven by the openai and
anthropic clients (or plain HTTP where a route has no client): the fields vLLM always sends, the legacy
logprobs order, /tokenize's vocabulary strings, forced tool calls (local $refs, a call cut by max_tokens, content
""), /invocations, /v1/chat/completions/batch, Responses' cancel, /load and /ping, the ORCA load header, and the
--enable-force-include-usage and --return-tokens-as-token-ids flags."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers import tiny_server_running, wait_until

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Say something"}]
OPTIONS = {"$defs": {"Options": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                                 "required": ["unit"], "additionalProperties": False}},
           "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "options": {"$ref": "#/$defs/Options"}},
           "required": ["city", "options"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": OPTIONS}}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "definitions": {"Days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "type": "object", "properties": {"days": {"$ref": "#/definitions/Days"}}, "required": ["days"]}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), {"max_model_len": 512}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


# ---- what every answer carries --------------------------------------------------------------------------------

def test_unasked_vllm_fields_are_there_as_null_for_clients_that_read_them(client):
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    assert chat.prompt_logprobs is None and chat.prompt_token_ids is None and chat.kv_transfer_params is None
    assert chat.choices[0].token_ids is None and chat.system_fingerprint is None
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    choice = done.choices[0]
    assert choice.prompt_logprobs is None and choice.prompt_token_ids is None and choice.token_ids is None
    asked = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"return_token_ids": True})
    assert asked.choices[0].token_ids and asked.choices[0].prompt_token_ids


def test_legacy_top_logprobs_put_the_chosen_token_first(client):
    """vLLM's order: the sampled token (or the prompt's token), then the top alternatives by rank."""
    done = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, logprobs=3, temperature=1.0,
                                      seed=5, echo=True)
    lp = done.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        if top is not None:
            assert next(iter(top)) == token
    assert any(next(iter(top)) != max(top, key=top.get) for top in lp.top_logprobs if top), \
        "no position sampled a token other than the most likely: the order was never tested"


def test_tokenize_token_strs_are_the_vocabulary_strings(server):
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(server.engine.config.model)
    got = post(server, "/tokenize", {"prompt": "Hello world, again", "return_token_strs": True}).json()
    assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])


# ---- forced tool calls -------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_with_local_refs_is_served_and_follows_them(client, choice):
    """$ref: '#/$defs/X' (and the older #/definitions/) inside a function's parameters: each function's definitions
    move with it into the grammar's schema, so `required` (which wraps every function) resolves them."""
    tool_choice = {"type": "function", "function": {"name": "weather"}} if choice == "named" else "required"
    chat = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, FORECAST],
                                          tool_choice=tool_choice, max_tokens=120, temperature=0.8, seed=3)
    message = chat.choices[0].message
    assert message.content == "" and chat.choices[0].finish_reason == "tool_calls", chat
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "weather":
            assert arguments["options"]["unit"] in ("c", "f")
        else:
            assert 1 <= arguments["days"] <= 7


def test_strict_tools_under_auto_follow_local_refs(client):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    chat = client.chat.completions.create(model="tiny", messages=ASK, tools=[strict], tool_choice="auto",
                                          max_tokens=150, temperature=0.8, seed=1)
    for call in chat.choices[0].message.tool_calls or []:
        assert json.loads(call.function.arguments)["options"]["unit"] in ("c", "f")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_no_call(client, choice):
    tool_choice = {"type": "function", "function": {"name": "weather"}} if choice == "named" else "required"
    chat = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                          max_tokens=2)
    assert chat.choices[0].finish_reason == "length"
    assert not chat.choices[0].message.tool_calls and chat.choices[0].message.content == ""


def test_a_responses_call_cut_by_max_output_tokens_is_no_call(server):
    body = {"model": "tiny", "input": "Say something", "max_output_tokens": 2, "tool_choice": {
        "type": "function", "name": "weather"}, "tools": [{"type": "function", **WEATHER["function"]}]}
    response = post(server, "/v1/responses", body).json()
    assert response["status"] == "incomplete"
    assert not [item for item in response["output"] if item["type"] == "function_call"]


# ---- the routes vLLM has ----------------------------------------------------------------------------------

def test_invocations_answers_a_chat_or_a_completion_by_its_body(server, client):
    chat = {"model": "tiny", "messages": ASK, "max_tokens": 4, "temperature": 0}
    assert post(server, "/invocations", chat).json()["choices"][0]["message"]["content"] == \
        client.chat.completions.create(**chat).choices[0].message.content
    done = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert post(server, "/invocations", done).json()["choices"][0]["text"] == \
        client.completions.create(**done).choices[0].text
    r = post(server, "/invocations", {"model": "tiny", "input": "x"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(server, "/invocations", {"model": "tiny", "messages": "not a list"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_batch_chat_answers_each_conversation_as_it_would_alone(server, client):
    conversations = [ASK, [{"role": "user", "content": "Another one"}], [{"role": "system", "content": "Be short"},
                                                                          *ASK]]
    body = {"model": "tiny", "messages": conversations, "max_tokens": 5, "temperature": 0}
    batch = post(server, "/v1/chat/completions/batch", body).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    alone = [client.chat.completions.create(model="tiny", messages=m, max_tokens=5, temperature=0)
             for m in conversations]
    assert [c["message"]["content"] for c in batch["choices"]] == [a.choices[0].message.content for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
    with httpx.stream("POST", server.url + "/v1/chat/completions/batch", json={**body, "stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert [texts[i] for i in range(3)] == [a.choices[0].message.content for a in alone]
    ids = post(server, "/v1/chat/completions/batch", {**body, "return_token_ids": True, "logprobs": True,
                                                      "return_tokens_as_token_ids": False}).json()
    # vLLM's batch answer: each choice its generated ids, no one prompt's ids; logprobs name real tokens
    assert ids["prompt_token_ids"] is None
    for choice, a in zip(ids["choices"], alone):
        assert len(choice["token_ids"]) == a.usage.completion_tokens
        assert "".join(e["token"] for e in choice["logprobs"]["content"]) == a.choices[0].message.content
        assert not any(e["token"].startswith("token_id:") for e in choice["logprobs"]["content"])
    for refused in ({"n": 2}, {"tools": [WEATHER]}, {"echo": True},
                    {"prompt_logprobs": 0}, {"prompt_logprobs": 1}, {"n": True}):
        r = post(server, "/v1/chat/completions/batch", {**body, **refused})
        assert r.status_code == 400 and next(iter(refused)) in r.json()["error"]["message"], r.text
    for asks_nothing in ({"n": 1}, {"tools": []}, {"echo": False}, {"prompt_logprobs": None}):
        assert post(server, "/v1/chat/completions/batch", {**body, **asks_nothing}).status_code == 200
    r = post(server, "/v1/chat/completions/batch", {**body, "messages": [ASK, [{"role": 5}]]})
    assert r.status_code == 400 and "messages.1.0.role" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/chat/completions/batch", {**body, "messages": [ASK, [{"role": "user"}]]})
    assert r.status_code == 400 and "conversation 1" in r.json()["error"]["message"], r.text
    assert wait_until(lambda: server.engine.kv.num_used == 0 and not server.engine.has_unfinished())


def test_cancelling_a_response_that_is_not_in_the_background_says_so(server, client):
    done = client.responses.create(model="tiny", input="Hi", max_output_tokens=3)
    r = post(server, f"/v1/responses/{done.id}/cancel", {})
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    assert post(server, "/v1/responses/resp_nothing/cancel", {}).status_code == 404


def test_load_counts_generation_requests_in_flight_until_their_last_byte(server, monkeypatch):
    step = server.engine.runner.execute

    def paced(sched):  # the tiny model would finish a stream before the count is read
        time.sleep(0.05)
        return step(sched)

    monkeypatch.setattr(server.engine.runner, "execute", paced)
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 30, "ignore_eos": True, "stream": True}
    started, seen = threading.Barrier(3), []

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait(30)
            started.wait(30)  # until the count is read
            for _ in lines:
                pass

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(30)
    seen.append(httpx.get(server.url + "/load").json()["server_load"])
    started.wait(30)
    for t in threads:
        t.join(120)
    assert seen == [2] and httpx.get(server.url + "/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/ping").json()["status"] == "ok" and httpx.post(server.url + "/ping").is_success


@pytest.mark.parametrize("form", ["TEXT", "JSON"])
def test_the_orca_load_header_answers_when_asked(server, form):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    r = post(server, "/v1/completions", body, headers={"endpoint-load-metrics-format": form})
    header = r.headers["endpoint-load-metrics"]
    if form == "TEXT":
        named = dict(part.removeprefix("named_metrics.").split("=") for part in header.removeprefix("TEXT ").split(", "))
    else:
        named = json.loads(header.removeprefix("JSON "))["named_metrics"]
    assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert 0 <= float(named["kv_cache_usage_perc"]) <= 1 and float(named["num_requests_waiting"]) == 0
    assert "endpoint-load-metrics" not in post(server, "/v1/completions", body).headers


# ---- vLLM's server flags --------------------------------------------------------------------------------------

def test_force_include_usage_and_token_ids_as_names_are_server_wide(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), force_include_usage=True,
                             return_tokens_as_token_ids=True) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": False}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        # vLLM's flag is continuous usage: every chunk says the usage so far, whatever the request asked
        assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=1)
        assert all(t.startswith("token_id:") for t in done.choices[0].logprobs.tokens)


def test_per_request_metrics_time_one_sequence_whole_and_on_the_final_usage_chunk(tiny_checkpoint):
    """vLLM's --enable-per-request-metrics, read through the openai SDK as vLLM's own test reads it."""
    with tiny_server_running(tiny_checkpoint("llama"), per_request_metrics=True) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                               extra_body={"min_tokens": 4})
        timing = whole.model_extra["metrics"]
        assert set(timing) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                               "tokens_per_second"} and all(v >= 0 for v in timing.values())
        assert timing["mean_itl_ms"] == pytest.approx(timing["generation_time_ms"] / 3)
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, stream=True,
                                                     stream_options={"include_usage": True}))
        assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
        last = chunks[-1].model_extra["metrics"]
        assert "mean_itl_ms" not in last and last["tokens_per_second"] > 0  # one token: no gap between tokens
        legacy = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert legacy.model_extra["metrics"]["generation_time_ms"] >= 0
        two = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, n=2)
        assert "metrics" not in two.model_extra  # two sequences: no one request to time (as vLLM)
    with tiny_server_running(tiny_checkpoint("llama")) as s:  # off by default
        assert "metrics" not in httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                                           "max_tokens": 2}).json()
