"""langchain-openai and litellm using structured outputs and tools against the live server (the tiny random
model): whatever the weights, what the grammar enforces must parse, name a declared tool and validate."""

from __future__ import annotations

import json

import jsonschema

from .test_chat_clients import run_driver

PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                        "kind": {"enum": ["cat", "dog"]}},
       "required": ["name", "age", "kind"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}


def test_langchain_structured_output_and_bind_tools(client_env, live, tmp_path):
    got = run_driver(client_env, live, tmp_path, "langchain_tools")
    for key in ("json_schema", "json_schema/stream", "function_calling", "function_calling/stream"):
        jsonschema.validate(got[key], PET)
    for key in ("bind_tools/any", "bind_tools/any/stream", "bind_tools/get_weather", "bind_tools/get_weather/stream"):
        assert got[key], key
        for call in got[key]:
            assert call["name"] == "get_weather" and call["id"].startswith("call_"), key
            jsonschema.validate(call["args"], {**WEATHER, "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}})
    auto = got["bind_tools/auto"]  # accepted and answered (a refusal fails the driver); whether to call is the model's
    assert isinstance(auto["content"], str) and all(call["name"] == "get_weather" for call in auto["tool_calls"])


def test_litellm_tools_and_response_format(client_env, live, tmp_path):
    got = run_driver(client_env, live, tmp_path, "litellm_tools")
    assert set(got) == {"openai", "hosted_vllm"}
    for provider, answer in got.items():
        assert answer["finish_reason"] == answer["streamed_finish_reason"] == "tool_calls", provider
        assert answer["calls"] == answer["streamed"], provider
        for call in answer["calls"]:
            assert call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), WEATHER)
        assert isinstance(json.loads(answer["json"])["name"], str), provider
