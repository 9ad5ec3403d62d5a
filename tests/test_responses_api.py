"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) driven by the real openai SDK
against a live server: whole and streamed responses with their event sequence, responses.parse into a pydantic
model, a function-call round trip with function_call_output, previous_response_id, the store, and refusals.
The same conversation gives the chat route's text."""

from __future__ import annotations

from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from tests.helpers import tiny_server_running, wait_until

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), {"max_model_len": 256}, api_key="sk-test") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)


def _chat_text(client, messages: list[dict], max_tokens: int) -> str:
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
    return chat.choices[0].message.content


def test_a_response_is_the_chat_routes_text_and_is_stored(server, client):
    response = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=6, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert response.output_text == _chat_text(client, chat, 6)
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    kept = client.responses.retrieve(response.id)
    assert kept.id == response.id and kept.output_text == response.output_text
    (asked,) = client.responses.input_items.list(response.id).data  # the input; instructions are not items
    assert asked.role == "user" and asked.content[0].text == "Name a colour."
    first = client.responses.create(model="tiny", input="One.", max_output_tokens=2, **GREEDY)
    chained = client.responses.create(model="tiny", input="Two.", previous_response_id=first.id,
                                      max_output_tokens=2, **GREEDY)
    newest = client.responses.input_items.list(chained.id, limit=2)  # its input, the first's output, the first's
    assert [i.type for i in newest.data] == ["message", "message"] and newest.has_more
    assert newest.data[0].content[0].text == "Two." and newest.data[1].role == "assistant"
    rest = client.responses.input_items.list(chained.id, limit=2, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["One."] and not rest.has_more
    oldest = client.responses.input_items.list(chained.id, order="asc", limit=1)
    assert oldest.data[0].content[0].text == "One."
    streamed = httpx.get(f"{server.url}/v1/responses/{chained.id}", params={"stream": "true"},
                         headers={"Authorization": "Bearer sk-test"})
    assert streamed.status_code == 400 and "not streamed in the background" in streamed.json()["error"]["message"]
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model="tiny", input="Say something.", max_output_tokens=5, **GREEDY)
    second = client.responses.create(model="tiny", input="And more.", previous_response_id=first.id,
                                     max_output_tokens=5, **GREEDY)
    chat = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And more."}]
    assert second.previous_response_id == first.id and second.output_text == _chat_text(client, chat, 5)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="tiny", input="x", previous_response_id=unstored.id, max_output_tokens=2)


def test_a_stream_sends_the_documented_events_numbered_and_the_same_text(client):
    kwargs = dict(model="tiny", input="Tell me a story.", max_output_tokens=8, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    stop = whole.output_text[3:5]  # ends it early: completed (the SDK's helper finishes on response.completed)
    assert stop.strip()
    ended = dict(model="tiny", input="Tell me a story.", max_output_tokens=8, temperature=0,
                 extra_body={"ignore_eos": True, "stop": [stop]})
    with client.responses.stream(**ended) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text
    assert whole.output_text.startswith(final.output_text) and stop not in final.output_text


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]  # short values: the tiny random model writes whatever the schema allows
    sunny: bool


def test_parse_fills_a_pydantic_model_from_the_enforced_schema(client):
    parsed = client.responses.parse(model="tiny", input="The weather in Paris?", text_format=Weather,
                                    max_output_tokens=200, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Weather)
    assert Weather.model_validate_json(parsed.output_text) == parsed.output_parsed


def test_a_function_call_round_trip_with_function_call_output(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model="tiny", input=asked, tools=[WEATHER], max_output_tokens=40,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    answered = client.responses.create(
        model="tiny", tools=[WEATHER], max_output_tokens=4, temperature=0, tool_choice="none",
        input=[*asked, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}])
    assert answered.output[0].type == "message"
    chained = client.responses.create(
        model="tiny", previous_response_id=called.id, tools=[WEATHER], max_output_tokens=4, temperature=0,
        tool_choice="none", input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}])
    assert chained.output_text == answered.output_text  # the stored call, then its output: the same prompt
    events = list(client.responses.create(model="tiny", input=asked, tools=[WEATHER], max_output_tokens=40,
                                           tool_choice="required", temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and events[-1].response.output[-1].arguments == done[-1].arguments


def _chat_logprobs(client, text: str, max_tokens: int, top: int) -> list:
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], temperature=0,
                                          max_tokens=max_tokens, logprobs=True, top_logprobs=top,
                                          extra_body={"ignore_eos": True})
    return [e.model_dump() for e in chat.choices[0].logprobs.content]


def _plain(entries) -> list:
    """Logprob entries as plain dicts (the delta events' own type has no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


def test_output_text_logprobs_are_the_chat_routes_whole_and_streamed(client):
    """include ["message.output_text.logprobs"] with top_logprobs: the output text's tokens with their
    alternatives, the numbers the chat route gives the same conversation; every streamed delta carries its own."""
    asked = dict(model="tiny", input="Say hello.", max_output_tokens=5, top_logprobs=3,
                 include=["message.output_text.logprobs"], **GREEDY)
    want = _chat_logprobs(client, "Say hello.", 5, 3)
    whole = client.responses.create(**asked)
    part = whole.output[0].content[0]
    assert [e.model_dump() for e in part.logprobs] == want and whole.top_logprobs == 3
    assert "".join(e["token"] for e in want) == part.text and all(len(e["top_logprobs"]) == 3 for e in want)
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs for e in deltas)
    assert _plain([lp.model_dump() for e in deltas for lp in e.logprobs]) == _plain(want)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump() for lp in done.logprobs] == want
    plain = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=5, **GREEDY)
    assert plain.output[0].content[0].logprobs == []  # not asked for, not computed


def test_what_this_server_cannot_do_is_refused_with_the_reason(server, client):
    for kwargs, says in ((dict(include=["reasoning.encrypted_content"]), "'reasoning.encrypted_content' is not"),
                         (dict(top_logprobs=2), "send that too"),
                         (dict(include=["message.output_text.logprobs"], tools=[WEATHER]), "tool_choice 'none'"),
                         (dict(tools=[{"type": "web_search"}]), "not run by this server"),
                         (dict(reasoning={"effort": "high"}), "does not reason"),
                         (dict(background=True, store=False), "background needs store"),
                         (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                          "text only"),
                         (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]), "reasoning item")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 2, **kwargs})
    assert httpx.get(f"{server.url}/v1/responses/resp_missing").status_code == 401  # behind the key



def _settled(client, response_id: str, timeout: float = 30.0):
    import time

    end = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > end:
            return response
        time.sleep(0.02)


def test_a_background_response_is_queued_then_read_back_with_the_foreground_text(server, client):
    asked = dict(model="tiny", input="Name a colour.", max_output_tokens=6, **GREEDY)
    foreground = client.responses.create(**asked)
    queued = client.responses.create(**asked, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _settled(client, queued.id)
    assert done.status == "incomplete" and done.background is True and done.output_text == foreground.output_text
    assert done.usage.output_tokens == 6
    with pytest.raises(openai.BadRequestError, match="still queued or in progress"):
        client.responses.cancel(done.id)
    assert wait_until(lambda: server.engine.kv.num_used == 0 and not server.engine.has_unfinished())


def test_cancelling_a_background_response_aborts_its_request(server, client):
    """A long reply cancelled while it runs: stored cancelled, its engine request gone, its blocks free."""
    for _ in range(5):  # a reply that finished before the cancel arrived is tried again
        running = client.responses.create(model="tiny", input="Tell a long story.", max_output_tokens=200,
                                           background=True, **GREEDY)
        try:
            cancelled = client.responses.cancel(running.id)
        except openai.BadRequestError:
            continue
        assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
        assert wait_until(lambda: server.engine.kv.num_used == 0 and not server.engine.has_unfinished())
        return
    pytest.fail("every background response finished before its cancel arrived")


def test_a_background_stream_is_read_again_from_any_event(server, client):
    asked = dict(model="tiny", input="Say hello.", max_output_tokens=5, background=True, stream=True, **GREEDY)
    events = list(client.responses.create(**asked))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.background is True
    response_id = events[0].response.id
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[3:]]
    assert client.responses.retrieve(response_id).output_text == events[-1].response.output_text
    r = httpx.get(f"{server.url}/v1/responses/{response_id}", params={"stream": "true", "include": "x"},
                  headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 400 and "include" in r.json()["error"]["message"]
