"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) driven by the real anthropic SDK
against a live server: whole and streamed replies, stop reasons, usage, a tool_use / tool_result round trip,
count_tokens, and errors in Anthropic's shape. The same conversation gives the chat route's text."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.helpers import tiny_server_running

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0, "ignore_eos": True}  # body fields: the SDK no longer takes sampling parameters
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                            "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), {"max_model_len": 256}, api_key="sk-test") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0)


def _chat_text(server, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-test"}, timeout=60,
                   json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_whole_message_is_the_chat_routes_text_with_anthropics_stop_reason_and_usage(server, client):
    conversation = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": [{"type": "text", "text": "Again, please."}]}]
    message = client.messages.create(model="tiny", max_tokens=7, system="You are terse.", messages=conversation,
                                     extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens" and message.stop_sequence is None
    (block,) = message.content
    chat = [{"role": "system", "content": "You are terse."}, *conversation[:2],
            {"role": "user", "content": "Again, please."}]
    assert block.type == "text" and block.text == _chat_text(server, chat, 7)
    usage = message.usage
    assert usage.output_tokens == 7
    counted = client.messages.count_tokens(model="tiny", system="You are terse.", messages=conversation)
    cached = usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert usage.input_tokens + cached == counted.input_tokens > 0


def _streamed_usage(client, text: str) -> tuple[int, object]:
    """(message_start's input_tokens, message_delta's usage) of a streamed one-token reply to `text`."""
    start, usage = None, None
    for event in client.messages.create(model="tiny", max_tokens=1, stream=True, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": text}]):
        if event.type == "message_start":
            start = event.message.usage.input_tokens
        elif event.type == "message_delta":
            usage = event.usage
    return start, usage


def test_cache_usage_says_what_a_prompt_wrote_into_the_prefix_cache_and_what_it_read(server, client):
    """Anthropic's three input counts add up to the prompt: a cold prompt writes its full blocks into the
    prefix cache (cache_creation_input_tokens), the same prompt again reads them (cache_read_input_tokens)."""
    text = f"Cache sentinel {uuid.uuid4().hex}. " * 4 + "Answer with one word."  # well inside max_model_len
    block = server.engine.config.block_size
    prompt, cold = _streamed_usage(client, text)
    assert cold.cache_read_input_tokens == 0 and cold.cache_creation_input_tokens == prompt // block * block > 0
    assert cold.input_tokens == prompt - cold.cache_creation_input_tokens
    again, warm = _streamed_usage(client, text)
    assert again == prompt and warm.cache_creation_input_tokens == 0  # its blocks are named already
    assert warm.cache_read_input_tokens == (prompt - 1) // block * block > 0  # the last token is always computed
    assert warm.input_tokens + warm.cache_read_input_tokens == prompt


def test_a_stream_gives_the_same_text_in_anthropics_events(server, client):
    kwargs = dict(model="tiny", max_tokens=9, messages=[{"role": "user", "content": "Tell me a story."}],
                  extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 9
    events = [e.type for e in client.messages.create(**kwargs, stream=True)]  # the SDK passes pings over
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    with httpx.stream("POST", f"{server.url}/v1/messages", headers={"x-api-key": "sk-test"}, timeout=60,
                      json={**{k: v for k, v in kwargs.items() if k != "extra_body"}, **GREEDY, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines[:3] == ["event: message_start", "event: ping", "event: content_block_start"]


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    kwargs = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Count."}], extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    message = client.messages.create(**kwargs, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and text.startswith(message.content[0].text)


def test_a_tool_use_and_tool_result_round_trip(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(model="tiny", max_tokens=40, messages=asked, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and use.input["city"] in ("Paris", "Rome")
    answered = [*asked, {"role": "assistant", "content": message.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21C"}]}]
    reply = client.messages.create(model="tiny", max_tokens=5, messages=answered, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.content[0].type == "text"
    with client.messages.stream(model="tiny", max_tokens=40, messages=asked, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and calls and all(isinstance(b.input, dict) for b in calls)


def test_errors_come_in_anthropics_shape_with_their_status(server, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-elsewhere", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    assert "serves 'tiny'" in missing.value.body["error"]["message"]
    refused = {"image": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                                   "media_type": "image/png",
                                                                                   "data": "AAAA"}}]}],
               "thinking": None, "web_search": None}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        client.messages.create(model="tiny", max_tokens=5, messages=refused["image"])
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "sk-test"}, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})  # max_tokens missing
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
