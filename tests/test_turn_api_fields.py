"""Every declared field of the Messages and Responses requests is honoured or refused: each honoured field changes
what reaches the engine (its prompt, sampling parameters, user / cache salt / session, request id) against the
same request without it, and each refused one is a 400 naming it. Fields the models do not declare are ignored
with a warning (as on the other routes)."""

from __future__ import annotations

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
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]}
# declared, and accepted as they ask for nothing to change: the prefix cache is always on, one tier, no reasoning
ASK_NOTHING = {"/v1/messages": {"cache_control": {"type": "ephemeral"}, "thinking": {"type": "disabled"},
                                "stream": False},
               "/v1/responses": {"prompt_cache_key": "k", "reasoning": {"effort": "none"}, "store": True,
                                 "metadata": {"tag": "x"}, "parallel_tool_calls": True, "stream": False}}
REFUSED = {"/v1/messages": {"container": "c", "mcp_servers": [{"url": "x"}], "context_management": {"edits": []},
                            "speed": "fast", "service_tier": "priority",
                            "thinking": {"type": "enabled", "budget_tokens": 1024},
                            "output_config": {"effort": "high"}},
           "/v1/responses": {"background": True, "conversation": "conv_1", "prompt": {"id": "p"},
                             "include": ["message.output_text.logprobs"], "max_tool_calls": 2, "top_logprobs": 2,
                             "truncation": "auto", "service_tier": "flex", "context_management": [{"type": "x"}],
                             "prompt_cache_retention": "24h", "reasoning": {"effort": "high"},
                             "stream_options": {"include_obfuscation": True}}}
# chat_template_kwargs reach the template, which refuses a variable it never reads (the tiny model's reads none
# of these) and a render argument the request sets itself
TEMPLATE_KWARGS = ({"enable_thinking": False}, "does not use enable_thinking"), \
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


def test_the_tables_cover_every_declared_field():
    """A field declared later must join one of the tables above."""
    walked = {"/v1/messages": {*MESSAGES_HONOURED, *ASK_NOTHING["/v1/messages"], *REFUSED["/v1/messages"],
                               *MESSAGES, *MESSAGES_UNSUPPORTED, "chat_template_kwargs"},
              "/v1/responses": {*RESPONSES_HONOURED, *ASK_NOTHING["/v1/responses"], *REFUSED["/v1/responses"],
                                *RESPONSES, *RESPONSES_UNSUPPORTED, "previous_response_id",
                                "chat_template_kwargs"}}
    assert set(MessagesRequest.model_fields) <= walked["/v1/messages"]
    assert set(ResponsesRequest.model_fields) <= walked["/v1/responses"]
