"""A function's parameters nested in the schema that wraps every function (tool_choice required, strict tools under
auto) keep their local references: jsonschema, the oracle, accepts and refuses the same arguments through the
wrapper as through the function's own schema."""

from __future__ import annotations

import pytest

from nanoserve.tools.spec import tool_request

jsonschema = pytest.importorskip("jsonschema")

SAME_NAME_A = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object",
               "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
SAME_NAME_B = {"definitions": {"Unit": {"type": "integer", "minimum": 0}}, "type": "object",
               "properties": {"unit": {"$ref": "#/definitions/Unit"}}, "required": ["unit"]}
RECURSIVE = {"type": "object", "properties": {"name": {"type": "string"},
                                              "children": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["name"]}
INNER_POINTER = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3},
                                                  "b": {"$ref": "#/properties/a"}}, "required": ["a", "b"]}
FUNCTIONS = {"a": SAME_NAME_A, "b": SAME_NAME_B, "tree": RECURSIVE, "pair": INNER_POINTER}
CASES = [("a", {"unit": "c"}), ("a", {"unit": 1}), ("b", {"unit": 3}), ("b", {"unit": "c"}), ("b", {"unit": -1}),
         ("tree", {"name": "x", "children": [{"name": "y", "children": []}]}),
         ("tree", {"name": "x", "children": [{"children": []}]}), ("pair", {"a": 1, "b": 2}), ("pair", {"a": 1, "b": 9})]


def wrapper() -> dict:
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in FUNCTIONS.items()]
    return tool_request(tools, "required", None).constraint().json


def test_every_argument_is_judged_through_the_wrapper_as_by_its_own_schema():
    wrapped = wrapper()
    jsonschema.Draft202012Validator.check_schema(wrapped)
    for name, arguments in CASES:
        alone = jsonschema.Draft202012Validator(FUNCTIONS[name]).is_valid(arguments)
        through = jsonschema.Draft202012Validator(wrapped).is_valid([{"name": name, "arguments": arguments}])
        assert alone == through, (name, arguments, alone)
    assert any(not jsonschema.Draft202012Validator(FUNCTIONS[n]).is_valid(a) for n, a in CASES)  # both kinds met


def test_functions_keep_their_own_definitions_of_the_same_name():
    defs = wrapper()["$defs"]
    assert defs["f0_Unit"] == {"enum": ["c", "f"]} and defs["f1_Unit"] == {"type": "integer", "minimum": 0}
    assert "f2___root" in defs and "$defs" not in defs["f0_Unit"]


def test_a_function_without_references_is_nested_as_it_is():
    plain = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": plain}}]
    schema = tool_request(tools, "required", None).constraint().json
    assert "$defs" not in schema and schema["items"]["anyOf"][0]["properties"]["arguments"] == plain
