"""Tool calls: the parsers against every way a reply can be split into deltas, `required` and a named function
enforced on the default model (arguments checked by jsonschema), `auto` parsed from a tiny Qwen2 checkpoint with a
Hermes-style template (its output scripted by a choice constraint), the history reaching the template, refusals."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from nanoserve import EngineConfig
from nanoserve.server.serve import Server
from nanoserve.tools.parsers import HermesCalls, NamedCall, RequiredCalls, joined

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def fed(parser, text: str, cuts: list[int]) -> tuple:
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    content, calls = joined(events + parser.finish())
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def every_split(text: str):
    yield []
    for i in range(1, len(text)):
        yield [i]


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <b>", "unit": "celsius"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_hermes_reads_the_same_calls_however_the_reply_is_split():
    want = ("Let me check. \n", [("get_weather", {"city": "Paris <b>", "unit": "celsius"}), ("add", {"a": 1, "b": 2})])
    for cuts in every_split(HERMES):
        assert fed(HermesCalls(), HERMES, cuts) == want, cuts


def test_hermes_keeps_what_is_not_a_call_as_content():
    assert fed(HermesCalls(), "a < b and <tool_ is fine", [3, 13]) == ("a < b and <tool_ is fine", [])
    broken = "<tool_call>\nnot json\n</tool_call> after"
    assert fed(HermesCalls(), broken, [5]) == (broken, [])
    cut = 'ok <tool_call>\n{"name": "add", "argu'
    assert fed(HermesCalls(), cut, [8]) == (cut, [])


REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "a \\"}]{ city", "unit": "celsius"}}, '
            '{"name": "add", "arguments": {"a": 3, "b": -4}}]')


def test_required_reads_each_call_however_the_reply_is_split():
    want = (None, [("get_weather", {"city": 'a "}]{ city', "unit": "celsius"}), ("add", {"a": 3, "b": -4})])
    for cuts in every_split(REQUIRED):
        assert fed(RequiredCalls(), REQUIRED, cuts) == want, cuts
    cut = REQUIRED[:70]
    content, calls = fed(RequiredCalls(), cut, [])
    assert calls == [] and content == ""  # the open element is neither a call nor content (vLLM's answer)


def test_named_streams_its_arguments_as_they_come():
    parser = NamedCall("add")
    events = parser.feed('{"a": ') + parser.feed('1, "b": 2}') + parser.finish()
    assert joined(events)[1][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


@pytest.fixture(scope="module")
def default_server():
    s = Server(EngineConfig(max_model_len=2048, kv_cache_gib=0.2), port=0, served_model_name="default").start()
    yield s
    s.stop()


def chat(server, **body) -> httpx.Response:
    base = {"model": "default", "messages": [{"role": "user", "content": "What's the weather in Paris, and 2+3?"}],
            "max_tokens": 150, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json={**base, **body}, timeout=120)


def streamed(server, **body) -> tuple[list[dict], str]:
    base = {"model": "default", "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
            "max_tokens": 150, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**base, **body}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for piece in chunk["choices"][0]["delta"].get("tool_calls") or ():
            call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            call["id"] = piece.get("id", call.get("id"))
            call["name"] += piece.get("function", {}).get("name", "")
            call["arguments"] += piece.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)], chunks[-1]["choices"][0]["finish_reason"]


def assert_valid(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_required_calls_a_declared_tool_with_valid_arguments(default_server, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    r = chat(default_server, tools=TOOLS, tool_choice="required", **sampling)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""  # forced: vLLM's ""
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for c in calls:
        assert_valid(c["function"]["name"], c["function"]["arguments"])


def test_required_streams_the_same_calls(default_server):
    calls, reason = streamed(default_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert_valid(calls[0]["name"], calls[0]["arguments"])
    whole = chat(default_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 messages=[{"role": "user", "content": "What's the weather in Paris?"}]).json()
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}


def test_a_named_function_is_called_with_valid_arguments(default_server):
    named = {"type": "function", "function": {"name": "add"}}
    r = chat(default_server, tools=TOOLS, tool_choice=named)
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    assert_valid("add", call["function"]["arguments"])
    same_question = [{"role": "user", "content": "What's the weather in Paris, and 2+3?"}]  # chat()'s
    calls, reason = streamed(default_server, tools=TOOLS, tool_choice=named, messages=same_question)
    assert reason == "tool_calls" and [c["name"] for c in calls] == ["add"]
    assert calls[0]["arguments"] == call["function"]["arguments"]  # greedy: streaming changes no byte
    assert_valid("add", calls[0]["arguments"])


def test_tools_reach_a_template_that_cannot_render_them_as_a_system_prompt(default_server):
    tokens = lambda **body: httpx.post(default_server.url + "/tokenize", json={  # noqa: E731
        "model": "default", "messages": [{"role": "user", "content": "hi"}], **body}).json()["count"]
    plain = chat(default_server, max_tokens=1).json()["usage"]["prompt_tokens"]
    with_tools = chat(default_server, max_tokens=1, tools=TOOLS).json()["usage"]["prompt_tokens"]
    without = chat(default_server, max_tokens=1, tools=TOOLS, tool_choice="none").json()["usage"]["prompt_tokens"]
    assert with_tools > plain + 50 and without == plain and tokens() > 0


def test_an_agents_history_reaches_the_model(default_server):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 and sunny"},
    ]
    r = chat(default_server, messages=history, tools=TOOLS, max_tokens=20)
    assert r.status_code == 200, r.text
    bare = [history[0], {"role": "assistant", "content": ""}]
    fewer = chat(default_server, messages=bare, tools=TOOLS, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens"] > fewer + 20  # the call, written into the text, and its result
    orphan = chat(default_server, messages=history[:1] + history[2:3], tools=TOOLS, max_tokens=1)
    assert orphan.status_code == 400 and "no earlier assistant tool call" in orphan.json()["error"]["message"]


@pytest.mark.parametrize("body,field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains it too"),
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}],
      "response_format": {"type": "json_object"}}, "strict tools under 'auto' enforce"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "more than once"),
])
def test_what_cannot_work_is_refused(default_server, body, field):
    r = chat(default_server, **{"tools": TOOLS, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_strict_tools_under_auto_are_enforced_by_a_grammar_of_text_or_hermes_calls(default_server):
    """auto with a strict function: text that never opens a call, or calls to declared functions whose arguments
    follow the strict schema; the same grammar the request runs under, token by token."""
    from nanoserve.structured.params import StructuredOutputsParams
    from nanoserve.tools.spec import hermes_grammar, tool_request

    strict = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}, TOOLS[0]]
    tools = tool_request(strict, "auto", None)
    assert tools.constraint() == StructuredOutputsParams(grammar=hermes_grammar(tools.functions, True))
    engine = default_server.host.serving()
    grammar = engine.grammars.compile(tools.constraint())

    def takes(text: str) -> bool:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        return grammar.matcher().valid_prefix(ids) == len(ids)

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert takes("Let me add them.") and takes("Sure. " + call) and takes(call + call + " Done.")
    assert takes('<tool_call>{"name": "get_weather", "arguments": {"anything": true}}</tool_call>')  # not strict
    assert not takes('<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>')
    assert not takes('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}</tool_call>')  # closed
    assert not takes('<tool_call>{"name": "subtract", "arguments": {}}</tool_call>')
    one = engine.grammars.compile(StructuredOutputsParams(grammar=hermes_grammar(tools.functions, False)))
    ids = engine.tokenizer.encode(call + call, add_special_tokens=False)
    assert one.matcher().valid_prefix(ids) < len(ids)  # parallel_tool_calls false: one call
    r = chat(default_server, tools=strict, max_tokens=60)
    assert r.status_code == 200, r.text
    for made in r.json()["choices"][0]["message"].get("tool_calls") or []:
        if made["function"]["name"] == "add":
            assert set(json.loads(made["function"]["arguments"])) == {"a", "b"}


HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.content %}
{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def hermes_server(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-hermes")
    shutil.copytree(tiny_checkpoint("qwen2"), path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    s = Server(EngineConfig(model=str(path), max_model_len=512, kv_cache_gib=0.02), port=0,
               served_model_name="tiny").start()
    yield s
    s.stop()


SCRIPTED = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def test_auto_parses_a_hermes_template_models_calls(hermes_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
            "max_tokens": 80, "temperature": 0, "structured_outputs": {"choice": [SCRIPTED]}}
    r = httpx.post(hermes_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    with httpx.stream("POST", hermes_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert content == "Checking. " and pieces[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Oslo", "unit": "celsius"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_template_gets_tools_and_history_calls_as_objects(hermes_server):
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c9", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "c9", "content": "-3"}]
    r = httpx.post(hermes_server.url + "/tokenize", json={"model": "tiny", "messages": history,
                                                          "return_token_strs": False}, timeout=60)
    assert r.status_code == 200, r.text
    engine = hermes_server.host.serving()
    from nanoserve.server.prompts import chat_prompt
    from nanoserve.server.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="tiny", messages=history, tools=TOOLS)
    text = engine.tokenizer.decode(chat_prompt(request, engine.tokenizer, request.tool_request()),
                                   skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '"arguments": {"city": "Oslo", "unit": "celsius"}' in text  # an object, not a quoted string
