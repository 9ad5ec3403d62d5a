"""Tool calls in the formats of the families beyond Qwen's Hermes blocks: Mistral's `[TOOL_CALLS]` (both its JSON
array and the v11 `name[ARGS]{...}` form) and Llama 3.1's JSON calls, read however the reply is split, text that
is no call kept as content, chosen from the chat template under tool_choice auto, and served to the openai client."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from nanoserve import EngineConfig
from nanoserve.server.serve import Server
from nanoserve.tools.parsers import Llama3JsonCalls, MistralCalls, RequiredCalls, parser_for, template_format
from nanoserve.tools.spec import ToolError, tool_request
from tests.test_tools import TOOLS, every_split, fed

OSLO = {"city": "Oslo", "unit": "celsius"}
MISTRAL_ARRAY = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
                 '"celsius"}}, {"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; ' \
         '{"name": "add", "parameters": {"a": 1, "b": 2}}'
BOTH = [("get_weather", OSLO), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("text, content", [(MISTRAL_ARRAY, "Let me check. "), (MISTRAL_V11, None)],
                         ids=["json-array", "v11"])
def test_mistral_reads_the_same_calls_however_the_reply_is_split(text, content):
    for cuts in every_split(text):
        assert fed(MistralCalls(), text, cuts) == (content, BOTH), cuts


def test_mistral_ids_are_nine_letters_and_digits_as_its_templates_demand():
    parser = MistralCalls()
    events = parser.feed(MISTRAL_V11) + parser.finish()
    ids = [e.id for e in events if hasattr(e, "id")]
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and ids[0] != ids[1]


def test_mistral_keeps_what_is_not_a_call_as_content():
    assert fed(MistralCalls(), "a [TOOL_ is not the tag", [4]) == ("a [TOOL_ is not the tag", [])
    for broken in ("[TOOL_CALLS] not json", '[TOOL_CALLS] [{"name": "add", "argu', "[TOOL_CALLS] [1, 2]",
                   '[TOOL_CALLS]add[ARGS]{"a": 1'):
        assert fed(MistralCalls(), "ok " + broken, [2]) == ("ok " + broken, []), broken


def test_llama3_reads_the_same_calls_however_the_reply_is_split():
    for text in (LLAMA3, LLAMA3.removeprefix("<|python_tag|>"), "  " + LLAMA3.replace("; ", ";")):
        for cuts in every_split(text):
            assert fed(Llama3JsonCalls(), text, cuts) == (None, BOTH), (text, cuts)


def test_llama3_text_streams_as_content_and_what_does_not_parse_stays_text():
    parser = Llama3JsonCalls()
    assert [e.text for e in parser.feed("It is ")] == ["It is "]  # a text reply streams at once
    assert [e.text for e in parser.feed('{"name": 1}')] == ['{"name": 1}'] and parser.finish() == []
    for text in ('{"name": "add", "parameters": {"a": 1', '{"city": "Oslo"}', '{"name": "add"} and text',
                 '<|python_tag|>{"name": "add", "parameters": [1]}'):
        assert fed(Llama3JsonCalls(), text, [3]) == (text, []), text


MISTRAL_TEMPLATE = """{%- for m in messages %}
{%- if m.role == 'user' %}[INST] {% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{{ m.content }}[/INST]
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}[TOOL_CALLS] [
{%- for call in m.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- else %}{{ m.content }}</s>{% endif %}
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

LLAMA3_TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>
Given the following functions, please respond with a JSON for a function call with its proper arguments that best
answers the given prompt. Respond in the format {"name": function name, "parameters": dictionary of argument name and
its value}. Do not use variables.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{% if m.tool_calls %}{% for call in m.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor %}<|start_header_id|>assistant<|end_header_id|>
"""


def test_auto_takes_the_templates_format_and_refuses_strict_functions_it_cannot_enforce():
    assert template_format(MISTRAL_TEMPLATE) == "mistral" and template_format(LLAMA3_TEMPLATE) == "llama3_json"
    auto = tool_request(TOOLS, "auto", None)
    assert parser_for(auto, MISTRAL_TEMPLATE, True) is MistralCalls
    assert parser_for(auto, LLAMA3_TEMPLATE, True) is Llama3JsonCalls
    assert parser_for(auto, MISTRAL_TEMPLATE, True, override="llama3_json") is Llama3JsonCalls
    assert parser_for(tool_request(TOOLS, "required", None), MISTRAL_TEMPLATE, True) is RequiredCalls
    strict = [{"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
    with pytest.raises(ToolError, match="mistral format"):
        parser_for(tool_request(strict, "auto", None), MISTRAL_TEMPLATE, True)


def _server(tiny_checkpoint, tmp_path_factory, template: str) -> Server:
    path = tmp_path_factory.mktemp("tool-format")
    shutil.copytree(tiny_checkpoint("qwen2"), path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(template)
    return Server(EngineConfig(model=str(path), max_model_len=512, kv_cache_gib=0.02), port=0,
                  served_model_name="tiny").start()


@pytest.fixture(scope="module")
def mistral_server(tiny_checkpoint, tmp_path_factory):
    s = _server(tiny_checkpoint, tmp_path_factory, MISTRAL_TEMPLATE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llama3_server(tiny_checkpoint, tmp_path_factory):
    s = _server(tiny_checkpoint, tmp_path_factory, LLAMA3_TEMPLATE)
    yield s
    s.stop()


def _scripted(client, reply: str, stream: bool = False, messages=None):
    """The model made to write `reply` (a one-choice grammar), tool_choice auto."""
    return client.chat.completions.create(
        model="tiny", messages=messages or [{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        max_tokens=120, temperature=0, stream=stream, extra_body={"structured_outputs": {"choice": [reply]}})


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("format_name", ["mistral", "llama3"])
def test_the_openai_client_gets_each_formats_calls_whole_and_streamed(format_name, mistral_server, llama3_server):
    server, reply, content = ((mistral_server, "Checking. " + MISTRAL_V11.split("[TOOL_CALLS]add")[0], "Checking. ")
                              if format_name == "mistral" else
                              (llama3_server, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": '
                                              '"celsius"}}', None))
    client = _openai(server)
    choice = _scripted(client, reply).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == OSLO
    chunks = list(_scripted(client, reply, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or ()]
    assert text == (content or "") and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == OSLO
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_mistral_call_comes_back_in_the_history_its_template_checks(mistral_server):
    """The id the server made is one Mistral's template takes back (it raises on any id not 9 letters and
    digits), so an agent's next turn renders."""
    client = _openai(mistral_server)
    call = _scripted(client, MISTRAL_V11.split("[TOOL_CALLS]add")[0]).choices[0].message.tool_calls[0]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "-3"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
