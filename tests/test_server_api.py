"""The server's answers for what clients actually send: echo and prompt logprobs, batches, n, refused content,
usage on every chunk, the extra routes and the OpenAPI document. Offline runs of the same engine are the oracle."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from nanoserve import SamplingParams

from .helpers import wait_until


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def offline(tiny_offline):
    return tiny_offline


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse_events(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def solo(offline, prompt, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 8, "ignore_eos": True, **kw})
    return offline.generate(prompt, params, use_tqdm=False)[0]


GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}


# ---- echo and the prompt's logprobs ---------------------------------------------------------------------

def test_echo_with_max_tokens_0_scores_the_prompt_like_the_offline_engine(server, offline):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = post(server, "/v1/completions", {**GREEDY, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ref = solo(offline, prompt, max_tokens=1, prompt_logprobs=2)
    ids = ref.prompt_token_ids
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(ref.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-5)
        top = lp["top_logprobs"][pos]
        assert lp["tokens"][pos] in top and 2 <= len(top) <= 3
    # text_offset: where each token's text starts in the returned text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert "".join(lp["tokens"]) == prompt


def test_echo_with_generation_returns_prompt_then_completion(server, offline):
    r = post(server, "/v1/completions", {**GREEDY, "prompt": "Once upon a time", "echo": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    expected = solo(offline, "Once upon a time")
    assert choice["text"] == "Once upon a time" + expected.outputs[0].text
    n_prompt = len(expected.prompt_token_ids)
    assert len(choice["logprobs"]["tokens"]) == n_prompt + 8
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(x is not None for x in choice["logprobs"]["token_logprobs"][1:])


def test_max_tokens_0_without_echo_is_refused(server):
    r = post(server, "/v1/completions", {**GREEDY, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_streamed_echo_starts_with_the_prompt(server, offline):
    events = sse_events(server, "/v1/completions", {**GREEDY, "prompt": "Once upon a time", "echo": True})
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == "Once upon a time" + solo(offline, "Once upon a time").outputs[0].text
    assert events[0]["choices"][0]["text"] == "Once upon a time"


# ---- batches and n --------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-lists"])
def test_a_batch_of_prompts_gives_one_choice_each_in_order(server, offline, as_ids):
    prompts = ["Once upon a time", "The capital of France", "def fib(n):"]
    tok = offline.get_tokenizer()
    sent = [tok.encode(p) for p in prompts] if as_ids else prompts
    r = post(server, "/v1/completions", {**GREEDY, "prompt": sent})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [solo(offline, p).outputs[0].text for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    assert body["usage"]["completion_tokens"] == 24
    streamed = sse_events(server, "/v1/completions", {**GREEDY, "prompt": sent})
    by_index = {}
    for e in streamed:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert [by_index[i] for i in range(3)] == [c["text"] for c in body["choices"]]


def test_n_and_batch_number_choices_prompt_major(server, offline):
    body = {"model": "tiny", "prompt": ["a b", "c d"], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 6,
            "ignore_eos": True}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = ["a b", "c d"][c["index"] // 2]
        ref = solo(offline, prompt, temperature=1.0, seed=5 + c["index"] % 2, max_tokens=6)
        assert c["text"] == ref.outputs[0].text
    assert choices[0]["text"] != choices[1]["text"]


def test_chat_n_streams_every_choice_with_its_role(server, offline):
    body = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "temperature": 0.8, "seed": 3}
    events = sse_events(server, "/v1/chat/completions", body)
    roles = [c["index"] for e in events[:2] for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    text = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
    whole = post(server, "/v1/chat/completions", body).json()["choices"]
    assert [text[0], text[1]] == [c["message"]["content"] for c in whole]


@pytest.mark.parametrize("prompt,needle", [
    ([False], "booleans are not token ids"),
    ([1, "a"], "not a mix"),
    ([[1, 2], "a"], "not a mix"),
    ([], "empty list"),
    ([[]], "list of lists of token ids"),
])
def test_bad_prompt_shapes_name_the_accepted_ones(server, prompt, needle):
    r = post(server, "/v1/completions", {**GREEDY, "prompt": prompt})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


# ---- chat content -------------------------------------------------------------------------------------

def test_a_request_chat_template_needs_the_servers_trust(server):
    body = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages[0].content }}"}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


def test_text_parts_are_joined_and_equal_the_string(server):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital of France?"}]
    ids = {**GREEDY, "return_token_ids": True}
    a = post(server, "/v1/chat/completions", {**ids, "messages": [{"role": "user", "content": parts}]})
    b = post(server, "/v1/chat/completions", {**ids, "messages": [
        {"role": "user", "content": "What is\nthe capital of France?"}]})
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    assert a.json()["prompt_token_ids"] == b.json()["prompt_token_ids"]  # the same prompt, token for token


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
     "text only"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}],
     "text only"),
    ([{"role": "user"}], "no content"),
    ([{"role": "user", "content": None}], "no content"),
    # a result for a call nobody made (templates that show no ids pair results with calls by order)
    ([{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
     "no earlier assistant tool call"),
    ([{"role": "user", "content": "weather?", "tool_call_id": "c1"}], "belongs on a tool message"),
])
def test_content_the_model_cannot_see_is_refused(server, messages, needle):
    r = post(server, "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert server.engine.kv.num_used == 0


# ---- streams: logprobs of held-back tokens, usage on every chunk --------------------------------------

def test_streamed_logprobs_cover_tokens_whose_text_was_held_back(server, offline):
    ref = solo(offline, "Once upon a time", max_tokens=16)
    tok = offline.get_tokenizer()
    held = tok.decode(list(ref.outputs[0].token_ids[2:5]))  # a stop string starts with this: held, then released
    body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 16, "logprobs": 1, "stop": [held + "\x00"]}
    events = sse_events(server, "/v1/completions", body)
    entries = [x for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert len(entries) == 16
    assert "".join(c["text"] for e in events for c in e["choices"]) == ref.outputs[0].text


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    body = {**GREEDY, "prompt": "Once upon a time", "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}}
    events = sse_events(server, "/v1/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all("usage" in e for e in events) and counts == sorted(counts) and counts[-1] == 8
    chat = sse_events(server, "/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "Hi"}],
                                                       "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": True}})
    assert all(e["usage"]["prompt_tokens"] > 0 for e in chat)


def test_user_is_kept_with_the_request_and_published_in_the_snapshot(offline):
    """The field walk shows the server hands `user` to the engine; the engine keeps it on the request's rows."""
    engine = offline.engine
    rid = engine.add_request("a b", SamplingParams(n=2, max_tokens=4), user="alice")
    rows = engine.stats().as_dict()["rows"]
    assert [(row["request_id"], row["user"]) for row in rows] == [(rid, "alice"), (f"{rid}#1", "alice")]
    while engine.has_unfinished():
        engine.step()


def test_a_batch_stream_closed_early_frees_every_request(server):
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200  # the batch really started streaming before it was closed
        next(r.iter_lines())
    assert wait_until(lambda: server.engine.kv.num_used == 0 and not server.engine.has_unfinished())


# ---- the other routes and the document ----------------------------------------------------------------

def test_model_tokenize_detokenize_version(server, offline):
    assert httpx.get(server.url + "/v1/models/tiny").json()["id"] == "tiny"
    r = httpx.get(server.url + "/v1/models/other")
    assert r.status_code == 404 and "not served" in r.json()["error"]["message"]
    tok = offline.get_tokenizer()
    t = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["tokens"] == tok.encode("Hello world") and t["count"] == len(t["tokens"]) and t["max_model_len"] == 128
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(server.engine.config.model)
    assert t["token_strs"] == hf.convert_ids_to_tokens(t["tokens"])  # vocabulary strings, as vLLM answers
    assert any(s.startswith("\u0120") for s in t["token_strs"])  # 'Ġworld': the byte-level piece, not " world"
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 128


@pytest.mark.parametrize("method,path,status", [("GET", "/nowhere", 404), ("GET", "/v1/completions", 405),
                                                ("DELETE", "/v1/models", 405)])
def test_404_and_405_are_openai_error_bodies(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_documents_the_error_bodies_metrics_and_live_limits(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    op = doc["paths"]["/v1/completions"]["post"]
    assert "422" not in op["responses"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    max_tokens = doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    assert {"type": "integer", "minimum": 0, "maximum": 127}.items() <= next(
        b for b in max_tokens["anyOf"] if b.get("type") == "integer").items()
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_unknown_fields_are_ignored_with_one_warning(server, caplog):
    body = {**GREEDY, "prompt": "hi", "a_field_from_the_future": 1}
    with caplog.at_level(logging.WARNING, logger="nanoserve.server"):
        first = post(server, "/v1/completions", body)
        second = post(server, "/v1/completions", body)
    assert first.status_code == second.status_code == 200
    warned = [r for r in caplog.records if "a_field_from_the_future" in r.getMessage()]
    assert len(warned) == 1
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Hi", "a_message_field": 1}]}
    with caplog.at_level(logging.WARNING, logger="nanoserve.server"):
        assert post(server, "/v1/chat/completions", chat).status_code == 200
    assert any("messages[].a_message_field" in r.getMessage() for r in caplog.records)
