"""Structured outputs against independent judges: jsonschema validates every JSON output, `re.fullmatch` every
regex output; the unconstrained rows of a mixed crowd equal their solo runs byte for byte; a bad constraint is
refused with its reason before anything is queued."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.errors import RequestError
from nanoserve.sampling import SamplingParamsError
from tests.test_engine_crowd import BLOCK_BYTES, MIXED, assert_same, make

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, role, tags and address."}]


def sampled(spec: dict, n: int, **extra) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=spec, **extra) for i in range(n)]


def test_default_model_json_schema_validates_20_of_20_at_temperature_1(default_llm):
    outs = default_llm.chat([ASK] * 20, sampled({"json": PERSON}, 20), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


JSON_ASKS = ["Return a JSON object with keys name and age for a person called Bob aged 30.",
             "Give me a JSON object describing a cat with its name and color.",
             "Reply with a JSON object whose key 'capital' names the capital of France.",
             'Output JSON: {"answer": <the sum of 2 and 3>}']


def test_default_model_json_object_always_parses(default_llm):
    """Every output that ends parses as an object. "Any object" lets a small model nest without end, and an
    output cut by max_tokens cannot parse whatever the grammar, so those are only checked to have started one
    (and most must end: the grammar does not keep the model from closing its object)."""
    convs = [[{"role": "user", "content": ask}] for ask in JSON_ASKS for _ in range(4)]
    outs = default_llm.chat(convs, sampled({"json_object": True}, len(convs)), use_tqdm=False)
    ended = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    for c in ended:
        assert isinstance(json.loads(c.text), dict), c.text
    for o in outs:
        assert o.outputs[0].text.startswith("{")
    assert len(ended) >= len(outs) // 2, [o.outputs[0].text[-80:] for o in outs]


def test_default_model_choice_and_regex_hold_exactly(default_llm):
    question = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    choices = ["yes", "no", "it depends"]
    for out in default_llm.chat([question] * 6, sampled({"choice": choices}, 6), use_tqdm=False):
        assert out.outputs[0].text in choices
    pattern = r"\d{3}-\d{4}( ext\. \d{1,3})?"
    phone = [{"role": "user", "content": "Make up a phone number."}]
    for out in default_llm.chat([phone] * 6, sampled({"regex": pattern}, 6), use_tqdm=False):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize("grammar", [
    'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ]{1,30}/',  # Lark
    'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30}',  # GBNF (llama.cpp)
], ids=["lark", "gbnf"])
def test_default_model_grammar_holds(default_llm, grammar):
    question = [{"role": "user", "content": "Is water wet?"}]
    for out in default_llm.chat([question] * 4, sampled({"grammar": grammar}, 4), use_tqdm=False):
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}", out.outputs[0].text), out.outputs[0].text


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


CONSTRAINED = [
    ("Give me JSON", SamplingParams(temperature=0.9, seed=2, max_tokens=60, structured_outputs={"json": PERSON})),
    ("Pick one", SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": ["red", "green"]})),
    ("Digits", SamplingParams(temperature=1.0, seed=4, max_tokens=12, structured_outputs={"regex": "[0-9]{3,8}"})),
]


@pytest.mark.parametrize("flags", [
    {},
    {"kv_cache_gib": 17 * BLOCK_BYTES / 2**30, "max_num_seqs": 13},  # preempts
    {"decode_buckets": True, "persistent_inputs": True, "row_compaction": True},
], ids=["plain", "preempting", "fast-path"])
def test_a_mixed_crowd_leaves_unconstrained_rows_byte_identical(ckpt, flags):
    solo_llm = make(ckpt)
    solo = [solo_llm.generate([p], s, use_tqdm=False)[0] for p, s in MIXED]
    solo_constrained = [solo_llm.generate([p], s, use_tqdm=False)[0] for p, s in CONSTRAINED]
    llm = make(ckpt, **flags)
    crowd = [*MIXED, *CONSTRAINED]
    outs = llm.generate([p for p, _ in crowd], [s for _, s in crowd], use_tqdm=False)
    assert_same(outs[: len(MIXED)], solo)
    assert_same(outs[len(MIXED):], solo_constrained)  # a constrained row is a function of its own history too
    text = [o.outputs[0].text for o in outs[len(MIXED):]]
    assert text[1] in ("red", "green") and re.fullmatch("[0-9]{3,8}", text[2])
    if text[0] and outs[len(MIXED)].outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text[0]), PERSON)
    if "max_num_seqs" in flags:
        assert llm.engine.stats().scheduler.preemptions > 0
    llm.engine.audit()
    stats = llm.engine.grammars.stats
    assert stats.compiles == 3 and stats.masked_rows > 0


def test_a_constraint_is_compiled_once_and_each_sequence_has_its_own_matcher(ckpt):
    llm = make(ckpt)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=8, structured_outputs={"regex": "[ab]{8}"})
    outs = llm.generate(["x", "y"], params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert all(re.fullmatch("[ab]{8}", t) for t in texts) and len(set(texts)) > 1
    assert llm.engine.grammars.stats.compiles == 1 and llm.engine.grammars.stats.cache_hits == 1


def test_min_tokens_never_forces_a_constrained_output_off_its_grammar(ckpt):
    llm = make(ckpt)
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["ok"]})
    out = llm.generate(["go"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_an_aborted_constrained_request_holds_nothing(ckpt):
    llm = make(ckpt)
    engine = llm.engine
    engine.add_request("abc", SamplingParams(max_tokens=50, structured_outputs={"json_object": True}),
                       request_id="gone")
    engine.step()
    engine.abort("gone")
    while engine.has_unfinished():
        engine.step()
    engine.audit()
    assert engine.kv.num_free == engine.kv.num_usable


@pytest.mark.parametrize("spec,message", [
    ({"json": {"type": "frobnicate"}}, "not usable"),
    ({"regex": "(unclosed"}, "not usable"),
    ({"grammar": "start: missing_rule"}, "not usable"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"json_object": True, "regex": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"json_schema": {}}, "unknown fields"),
])
def test_a_bad_constraint_is_refused_with_its_reason(ckpt, spec, message):
    llm = make(ckpt)
    with pytest.raises(RequestError, match=message):  # SamplingParamsError for its shape, compile errors too
        llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_ignore_eos_is_refused_with_a_constraint():
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(json_object=True))


@pytest.fixture(scope="module")
def roomy_tiny_server(tiny_checkpoint):
    """The tiny model served with room for a 200-token answer."""
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=320, kv_cache_gib=0.02), port=0,
               served_model_name="tiny").start()
    yield s
    s.stop()


def test_the_server_enforces_response_format_and_refuses_a_bad_schema(roomy_tiny_server):
    url = roomy_tiny_server.url + "/v1/chat/completions"
    # The output is bounded, so even random weights must close it within max_tokens: 3 digits at most, 12
    # characters of syntax, and at most 33 characters of whitespace in each of the 5 places JSON allows it
    # (JSON_WHITESPACE): 180 characters, and every token the grammar allows writes at least one.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "n?"}], "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 3}}}}
    refused = httpx.post(url, json=bad, timeout=60)
    assert refused.status_code == 400 and "json" in refused.json()["error"]["message"]
    both = {**body, "structured_outputs": {"regex": "a"}}
    refused = httpx.post(url, json=both, timeout=60)
    assert refused.status_code == 400 and "each constrain the output" in refused.json()["error"]["message"]
    streamed = {**body, "stream": True, "response_format": {"type": "json_object"}}
    with httpx.stream("POST", url, json=streamed, timeout=60) as resp:
        pieces = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text.lstrip().startswith("{")


def test_the_openai_client_parses_into_a_pydantic_model(default_server_url):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=100_000_000)

    client = openai.OpenAI(base_url=default_server_url + "/v1", api_key="none")
    done = client.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=200, temperature=0)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    with client.chat.completions.stream(
            model="default", messages=[{"role": "user", "content": "Describe Rome as JSON."}],
            response_format=City, max_tokens=200, temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


@pytest.fixture(scope="module")
def default_server_url():
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    s = Server(EngineConfig(max_model_len=1024, kv_cache_gib=0.1), port=0, served_model_name="default").start()
    yield s.url
    s.stop()


def test_the_cli_takes_a_constraint(tiny_checkpoint, capsys):
    from nanoserve.cli import main

    argv = ["generate", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "128", "--kv-cache-gib",
            "0.01", "--max-tokens", "6", "--structured-outputs", '{"regex": "[xyz]{6}"}', "Say"]
    assert main(argv) == 0
    assert re.fullmatch("[xyz]{6}", capsys.readouterr().out.strip())


def test_llm_accepts_vllms_offline_form(ckpt):
    llm = LLM(model=str(ckpt), max_model_len=128, kv_cache_gib=0.01)
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    out = llm.generate(["?"], SamplingParams(temperature=0, max_tokens=5, structured_outputs=spec), use_tqdm=False)
    assert out[0].outputs[0].text in ("alpha", "beta")


def test_disable_additional_properties_closes_every_listed_object():
    from nanoserve.structured.schema import closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"e": {"properties": {}}}, "anyOf": [{"properties": {"f": {}}, "additionalProperties": True}]}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["$defs"]["e"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


def test_an_open_schema_can_be_closed_per_request(ckpt):
    llm = make(ckpt)
    schema = {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"]}
    spec = {"json": schema, "disable_additional_properties": True, "disable_any_whitespace": True}
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec), use_tqdm=False)
    assert out[0].outputs[0].text == '{"k":"v"}'


def test_the_stats_snapshot_counts_compiles_and_masks(ckpt):
    llm = make(ckpt)
    assert "structured" not in llm.engine.stats().as_dict()  # absent until a constraint is used
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"regex": "[0-9]{4}"})
    llm.generate(["a", "b"], params, use_tqdm=False)
    section = llm.engine.stats().as_dict()["structured"]
    assert section["compiles"] == 1 and section["cache_hits"] == 1
    assert section["masked_rows"] == 8 and section["mask_ms_per_row"] > 0 and section["compile_ms"] > 0
