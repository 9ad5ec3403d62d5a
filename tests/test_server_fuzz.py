"""Fuzzed request bodies: every one is a 4xx with an error body or a 200, never a 5xx, and the server stays up."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import EngineConfig
from nanoserve.server.serve import Server

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "n", "stream", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "ignore_eos", "stream_options", "echo", "max_completion_tokens",
          "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "best_of", "user", "request_id",
          "add_special_tokens", "truncate_prompt_tokens", "return_tokens_as_token_ids", "response_format",
          "chat_template", "chat_template_kwargs", "documents", "continue_final_message", "add_generation_prompt",
          "suffix", "tools", "tokens", "return_token_strs", "system", "stop_sequences", "tool_choice", "thinking",
          "metadata", "output_config"]
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x", "image", "tool_use",
                                                                 "tool_result"]),
                                        "text": st.one_of(st.text(max_size=10), st.integers())},
                                       optional={"id": st.text(max_size=5), "name": st.text(max_size=5),
                                                 "input": VALUES, "tool_use_id": st.text(max_size=5),
                                                 "content": VALUES}), max_size=3)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                           "content": st.one_of(st.text(max_size=30), st.none(), st.integers(),
                                                                PARTS)}),
                    max_size=3)
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6) | st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 60000), max_size=8))},
    optional={"max_tokens": st.integers(-3, 200), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
              "top_k": st.integers(-2, 100), "stop": st.lists(st.text(max_size=3), max_size=3),
              "stream": st.booleans(), "logprobs": st.integers(-1, 25)}) | st.fixed_dictionaries(
    {"messages": MESSAGES}, optional={"max_tokens": st.integers(-3, 200), "stream": st.booleans(),
                                      "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25)})


# Anthropic's shape, with the served model's name ("SERVED" is replaced by it): past validation to the translation
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.just("SERVED"), "max_tokens": st.integers(-1, 8),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": st.one_of(st.text(max_size=20), PARTS)}),
                          min_size=1, max_size=3)},
    optional={"system": st.one_of(st.text(max_size=10), PARTS, VALUES), "stream": st.booleans(),
              "stop_sequences": VALUES, "temperature": VALUES, "top_k": VALUES, "tools": VALUES,
              "tool_choice": st.one_of(VALUES, st.fixed_dictionaries({"type": st.sampled_from(
                  ["auto", "any", "tool", "none", "x"])}, optional={"name": st.text(max_size=5)})),
              "thinking": VALUES, "output_config": VALUES, "metadata": VALUES})


# OpenAI's Responses shape: items of every kind, tools and formats of any value
ITEMS = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "x"]),
                           "content": st.one_of(st.text(max_size=20), PARTS, VALUES)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "x"])},
                          optional={"call_id": VALUES, "name": VALUES, "arguments": VALUES, "output": VALUES})),
    max_size=3)
RESPONSES = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=20), ITEMS)},
    optional={"instructions": VALUES, "max_output_tokens": st.integers(-1, 8), "stream": st.booleans(),
              "tools": VALUES, "tool_choice": VALUES, "text": VALUES, "store": VALUES, "reasoning": VALUES,
              "previous_response_id": VALUES, "include": VALUES, "temperature": VALUES})


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    s = Server(config, port=0, trust_request_chat_template=True).start()  # fuzzed templates reach the parser
    yield s
    s.stop()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES | ANTHROPIC | RESPONSES,
       route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/messages",
                              "/v1/messages/count_tokens", "/v1/responses"]))
def test_fuzzed_bodies_never_5xx(server, body, route):
    if body.get("model") == "SERVED":
        body["model"] = server.model_name
    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 8:
        body["max_output_tokens"] = 8
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep generated work small; validity is what is being fuzzed
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4
    # json.dumps writes NaN/Infinity, which strict JSON lacks: the server must refuse those too.
    r = httpx.post(server.url + route, content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400 and route.startswith("/v1/messages"):  # Anthropic's error shape
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    elif r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_server_still_serves_after_the_fuzz(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    h = httpx.get(server.url + "/health").json()
    assert h["kv"]["blocks_free"] == h["kv"]["blocks_total"]
