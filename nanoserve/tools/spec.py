"""A chat request's tools and tool_choice, checked, and what each choice asks of the engine.

- `none`: the tools are neither shown to the model nor parsed; the reply is text.
- `auto`: the tools reach the prompt and the reply is parsed for calls in the model's own format.
- `required`: the reply is a JSON array of one or more calls to declared tools, enforced by the grammar engine
  (one call when parallel_tool_calls is false), so it works on any model.
- a named function: the reply is that function's arguments, enforced by its parameters schema.
- `auto` with a `strict` function: the reply is text with Hermes `<tool_call>` blocks (the format the auto parser
  reads), enforced by a Lark grammar: text that never writes the tag, or calls whose name is declared and whose
  arguments follow the strict function's schema (any object for a function that is not strict).
Enforced arguments hold only the parameters a function declares (its objects closed to other keys, as OpenAI's
strict mode requires of a schema), unless its schema sets additionalProperties itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import RequestError
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.tools.embedded import embedded

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolError(RequestError):
    """A tools or tool_choice value the server refuses; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: Mapping[str, Any]
    strict: bool = False  # OpenAI's strict: its arguments follow the schema, enforced here under auto too

    def as_tool(self) -> dict:
        """OpenAI's tool shape, which chat templates read."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces `required`, a named function, or `auto` with a strict function; None for
        none and for auto without strict functions (the reply is parsed as written)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=dict(self.function(self.named).parameters),
                                           disable_additional_properties=True)
        if self.choice == "required":
            arguments, defs = embedded_arguments(self.functions, lambda f: dict(f.parameters))
            calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": a},
                                "required": ["name", "arguments"], "additionalProperties": False}
                               for f, a in zip(self.functions, arguments)]}
            schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1, **defs}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, disable_additional_properties=True)
        if self.choice == "auto" and any(f.strict for f in self.functions):
            return StructuredOutputsParams(grammar=hermes_grammar(self.functions, self.parallel))
        return None

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)

    def template_tools(self) -> list[dict] | None:
        return None if self.choice == "none" else [f.as_tool() for f in self.functions]


def hermes_grammar(functions: Sequence[Function], parallel: bool) -> str:
    """Text, then Hermes calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), as a Lark grammar.

    The text is one lazy lexeme that ends at the tag, so a call cannot hide inside text: the plain-text branch
    may never contain `<tool_call>` at all. A strict function's arguments follow its schema, closed to undeclared
    keys; another's are any object."""
    from nanoserve.structured.schema import closed

    arguments, defs = embedded_arguments(functions, lambda f: closed(dict(f.parameters)) if f.strict else ANY_OBJECT)
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": a},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for f, a in zip(functions, arguments)], **defs}
    return "\n".join([
        "start: FINAL? | calls",
        f"calls: call{'+' if parallel else ''} FINAL?",
        'call: prose WS? body WS? "</tool_call>"',
        "prose[lazy]: /(.|\\n)*<tool_call>/",
        f"body: %json {json.dumps(calls)}",
        "WS: /[ \\t\\n]+/",
        "FINAL: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",
    ])


def embedded_arguments(functions: Sequence[Function], schema_of) -> tuple[list[dict], dict]:
    """Each function's arguments schema (`schema_of(f)`) ready to nest in one wrapper, and the `$defs` the
    wrapper's root carries for them ({} when none has definitions or references): tools/embedded.py."""
    arguments, defs = [], {}
    for i, f in enumerate(functions):
        schema, own = embedded(schema_of(f), f"f{i}_")
        arguments.append(schema)
        defs.update(own)
    return arguments, ({"$defs": defs} if defs else {})


def tool_request(tools: Sequence[Mapping] | None, tool_choice: Any, parallel_tool_calls: bool | None
                 ) -> ToolRequest | None:
    """The request's tools as a ToolRequest (None without tools); ToolError names what cannot work."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice", f"tool_choice {tool_choice!r} needs tools; send the tools it may call")
        if parallel_tool_calls is not None:
            raise ToolError("parallel_tool_calls", "parallel_tool_calls applies to tool calls; send tools too")
        return None
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", f"tools declare {sorted({n for n in names if names.count(n) > 1})} more than once; "
                                 "give each function a distinct name")
    choice = "auto" if tool_choice is None else tool_choice
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", "a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools ({names})")
        return ToolRequest(functions, "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                                       f"{choice!r}")
    return ToolRequest(functions, choice, None, parallel)


def _function(tool: Mapping, i: int) -> Function:
    fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"tools.{i}", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                      "'parameters': {...}}}}}")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, Mapping):
        raise ToolError(f"tools.{i}.function.parameters", f"tools[{i}].function.parameters must be a JSON schema "
                                                          "object")
    description = fn.get("description")
    return Function(fn["name"], description if isinstance(description, str) else None, parameters,
                    fn.get("strict") is True)
