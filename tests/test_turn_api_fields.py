"""Every declared field of the Messages and Responses requests is honoured or refused: each honoured field changes
what reaches the engine (its prompt, sampling parameters, user / cache salt / session, request id) against the
same request without it, and each refused one is a 400 naming it. Fields the models do not declare are ignored
with a warning (as on the other routes)."""

from __future__ import annotations

import json

import httpx
import pytest

from nanoserve.server.messages_protocol import MESSAGES_UNSUPPORTED, MessagesRequest
from nanoserve.server.responses_protocol import RESPONSES_UNSUPPORTED, ResponsesRequest
from tests.helpers import tiny_server_running

ASK = [{"role": "user", "content": "Hi there"}]
MESSAGES = {"model": "tiny", "max_tokens": 3, "messages": ASK}
RESPONSES = {"model": "tiny", "max_output_tokens": 3, "input": "Hi there"}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# honoured field -> a value that asks for something (each must change what reaches the engine)
SAMPLING = {"temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 7, "repetition_penalty": 1.2,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 1, "stop_token_ids": [5],
            "ignore_eos": True, "request_id": "walked", "cache_salt": "salt", "session_id": "session"}
MESSAGES_HONOURED = {**SAMPLING, "system": "Be brief.", "stop_sequences": ["zz"], "metadata": {"user_id": "u1"},
                     "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
                     "tools": [{"name": "f", "input_schema": SCHEMA}],
                     "tool_choice": {"type": "tool", "name": "f"}, "max_tokens": 4,
                     "messages": [*ASK, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "x"}]}
RESPONSES_HONOURED = {**SAMPLING, "instructions": "Be brief.", "stop": ["zz"], "user": "u1", "safety_identifier": "u2",
                      "text": {"format": {"type": "json_schema", "name": "o", "schema": SCHEMA}},
                      "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
                      "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 4,
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
                      # vLLM's chat fields on its Responses request, honoured as the chat route honours them
                      "logit_bias": {"5": 1.0}, "skip_special_tokens": False, "include_stop_str_in_output": True,
                      "structured_outputs": {"choice": ["yes", "no"]},
                      "include": ["message.output_text.logprobs"]}  # logprobs computed: the params change
# declared, and accepted as they ask for nothing to change: the prefix cache is always on, one tier, no reasoning
ASK_NOTHING = {"/v1/messages": {"cache_control": {"type": "ephemeral"}, "thinking": {"type": "disabled"},
                                "stream": False},
               "/v1/responses": {"prompt_cache_key": "k", "reasoning": {"effort": "none"}, "store": True,
                                 "metadata": {"tag": "x"}, "parallel_tool_calls": True, "stream": False,
                                 "prompt_cache_options": {"mode": "implicit"}, "include_reasoning": True,
                                 "include": [], "top_logprobs": 0, "background": False}}
# vLLM's fields that the chat request refuses unless they ask for nothing, on both turn APIs
VLLM_REFUSED = {"mm_payload": "none", "return_mm_kwargs": True, "watermarking": True, "kv_transfer_params": {"a": 1},
                "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}}
REFUSED = {"/v1/messages": {"container": "c", "mcp_servers": [{"url": "x"}], "context_management": {"edits": []},
                            "speed": "fast", "service_tier": "priority",
                            "thinking": {"type": "enabled", "budget_tokens": 1024},
                            "output_config": {"effort": "high"}, **VLLM_REFUSED},
           "/v1/responses": {"conversation": "conv_1", "prompt": {"id": "p"},
                             "include": ["reasoning.encrypted_content"], "max_tool_calls": 2,
                             "top_logprobs": 2,  # without include it counts alternatives of nothing
                             "truncation": "auto", "service_tier": "flex", "context_management": [{"type": "x"}],
                             "prompt_cache_retention": "24h", "reasoning": {"effort": "high"},
                             "stream_options": {"include_obfuscation": True},
                             "prompt_cache_options": {"mode": "explicit"},
                             "previous_input_messages": [{"role": "user", "content": "x"}], "priority": 1,
                             "include_reasoning": False, "spaces_between_special_tokens": False,
                             "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"a": 1}, **VLLM_REFUSED}}
# chat_template_kwargs reach the template, which refuses a variable it never reads (the tiny model's reads none
# of these) and a render argument the request sets itself
TEMPLATE_KWARGS = ({"enable_thinking": True}, "does not use enable_thinking"), \
    ({"add_generation_prompt": False}, "which the request sets itself")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), {"max_model_len": 256}) as s:
        yield s


@pytest.fixture
def seen(server, monkeypatch):
    engine, calls = server.engine, []
    real = engine.add_request

    def spy(prompt, params=None, **kwargs):
        calls.append((list(prompt), repr(params), (kwargs.get("user"), kwargs.get("cache_salt"),
                                                   kwargs.get("session_id")), kwargs.get("request_id")))
        return real(prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    return calls


def reached(server, seen, route: str, body: dict) -> tuple:
    seen.clear()
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 200, (body, r.text)
    (call,) = seen
    return call[:3] + (call[3].split("-", 1)[1] if "walked" in call[3] else "",)


@pytest.mark.parametrize("route,base,honoured", [("/v1/messages", MESSAGES, MESSAGES_HONOURED),
                                                 ("/v1/responses", RESPONSES, RESPONSES_HONOURED)])
def test_every_honoured_field_changes_what_reaches_the_engine(server, seen, route, base, honoured):
    plain = reached(server, seen, route, base)
    for name, value in honoured.items():
        with_tools = {**base, "tools": honoured["tools"]}  # tool_choice against the same tools under auto
        before = reached(server, seen, route, with_tools) if name == "tool_choice" else plain
        after = reached(server, seen, route, {**(with_tools if name == "tool_choice" else base), name: value})
        assert after != before, name
    for name, value in ASK_NOTHING[route].items():
        assert reached(server, seen, route, {**base, name: value}) == plain, name


@pytest.mark.parametrize("route,base", [("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES)])
def test_every_field_that_asks_for_what_this_server_cannot_do_is_refused_by_name(server, route, base):
    for name, value in REFUSED[route].items():
        body = {**base, name: value, **({"stream": True} if name == "stream_options" else {})}
        r = httpx.post(server.url + route, json=body, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and name.split(".")[0] in message, (name, r.text)


@pytest.mark.parametrize("route,base", [("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES),
                                        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "messages": ASK})])
def test_chat_template_kwargs_reach_the_template_checks(server, route, base):
    for kwargs, says in TEMPLATE_KWARGS:
        r = httpx.post(server.url + route, json={**base, "chat_template_kwargs": kwargs}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route,base", [("/v1/messages", MESSAGES), ("/v1/responses", RESPONSES),
                                        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "messages": ASK})])
def test_a_template_variable_set_to_false_asks_nothing_of_a_template_that_never_reads_it(server, route, base):
    """enable_thinking false on a model that never thinks is what happens anyway (vLLM accepts it too)."""
    r = httpx.post(server.url + route, json={**base, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_tables_cover_every_declared_field():
    """A field declared later must join one of the tables above."""
    walked = {"/v1/messages": {*MESSAGES_HONOURED, *ASK_NOTHING["/v1/messages"], *REFUSED["/v1/messages"],
                               *MESSAGES, *MESSAGES_UNSUPPORTED, "chat_template_kwargs"},
              "/v1/responses": {*RESPONSES_HONOURED, *ASK_NOTHING["/v1/responses"], *REFUSED["/v1/responses"],
                                *RESPONSES, *RESPONSES_UNSUPPORTED, "previous_response_id",
                                "chat_template_kwargs", "enable_response_messages"}}
    assert set(MessagesRequest.model_fields) <= walked["/v1/messages"]
    assert set(ResponsesRequest.model_fields) <= walked["/v1/responses"]


@pytest.mark.parametrize("stream", [False, True])
def test_enable_response_messages_returns_the_rendered_prompt_and_the_raw_reply(server, stream):
    """vLLM's enable_response_messages: the prompt as the template rendered it and the reply as written, each with
    its token ids (the tokenizer's own encoding of the text)."""
    body = {**RESPONSES, "enable_response_messages": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        response = events[-1]["response"]
    else:
        response = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    (given,), (said,) = response["input_messages"], response["output_messages"]
    tokenizer = server.engine.tokenizer
    assert given["type"] == said["type"] == "raw_message_tokens"
    assert given["tokens"] == tokenizer.encode(given["message"], add_special_tokens=False)
    assert "Hi there" in given["message"] and len(given["tokens"]) == response["usage"]["input_tokens"]
    assert tokenizer.decode(said["tokens"]) == said["message"] == response["output"][0]["content"][0]["text"]
    assert len(said["tokens"]) == response["usage"]["output_tokens"]
    plain = httpx.post(server.url + "/v1/responses", json=RESPONSES, timeout=60).json()
    assert "input_messages" not in plain and "output_messages" not in plain
