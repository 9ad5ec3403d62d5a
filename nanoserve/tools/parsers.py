"""Reading tool calls out of a reply as it streams: text in, events out.

Each parser takes the reply's text delta by delta (`feed`) and once more at its end (`finish`), and answers with
events: `Content` (text for message.content), `CallStart` (a call's index, id and name) and `Arguments` (a piece
of that call's arguments, JSON text). A streamed response turns each event into its delta; a whole response
joins them. Text a parser cannot read as a call is never dropped: it comes back as content.

- `NamedCall`: the reply is the named function's arguments (the grammar made it so): streamed as they come.
- `RequiredCalls`: the reply is a JSON array of {"name", "arguments"} objects: each call goes out once its
  object is complete.
- `HermesCalls` (auto): text, with calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (the Hermes format of Qwen2.5's templates, and of nanoserve's own tool prompt).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class NamedCall:
    forced = True  # the grammar made the reply a call: its message content is "" (vLLM's), never the text

    def __init__(self, name: str):
        self.name, self._started = name, False

    def feed(self, text: str) -> list:
        events = [] if self._started else [CallStart(0, call_id(), self.name)]
        self._started = True
        return events + ([Arguments(0, text)] if text else [])

    def finish(self) -> list:
        return self.feed("")


class RequiredCalls:
    """A JSON array of calls, split into its elements as they close (outside strings, at depth 1)."""

    forced = True

    def __init__(self):
        self._buffer, self._depth, self._in_string, self._escaped = "", 0, False, False
        self._element_start, self._calls = None, 0

    def feed(self, text: str) -> list:
        events = []
        for ch in text:
            self._buffer += ch
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string, self._escaped = True, False
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element_start = len(self._buffer) - 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._element_start is not None:
                    events += self._call(self._buffer[self._element_start:])
                    self._element_start = None
        return events

    def _call(self, element: str) -> list:
        try:
            value = json.loads(element)
            name, arguments = value["name"], value["arguments"]
        except (ValueError, KeyError, TypeError):
            return [Content(element)]
        index, self._calls = self._calls, self._calls + 1
        return [CallStart(index, call_id(), name), Arguments(index, json.dumps(arguments, ensure_ascii=False))]

    def finish(self) -> list:
        """A reply cut short (max_tokens) leaves an element open: it is no call, and no content either (the
        reply was forced to be calls; finish_reason says it was cut), as vLLM answers."""
        self._element_start = None
        return []


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesCalls:
    """Content with `<tool_call>` blocks; text that may still become a tag's start is held back."""

    forced = False

    def __init__(self):
        self._pending, self._inside, self._calls = "", False, 0

    def feed(self, text: str) -> list:
        self._pending += text
        events = []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return events
                events += self._call(self._pending[:end])
                self._pending, self._inside = self._pending[end + len(CLOSE):], False
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                if start:
                    events.append(Content(self._pending[:start]))
                self._pending, self._inside = self._pending[start + len(OPEN):], True
                continue
            keep = _partial_tag(self._pending)
            if len(self._pending) > keep:
                events.append(Content(self._pending[: len(self._pending) - keep]))
                self._pending = self._pending[len(self._pending) - keep:]
            return events

    def _call(self, body: str) -> list:
        try:
            value = json.loads(body)
            name, arguments = value["name"], value.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            return [Content(OPEN + body + CLOSE)]  # not a call after all: the model's text, as it wrote it
        index, self._calls = self._calls, self._calls + 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return [CallStart(index, call_id(), name), Arguments(index, text)]

    def finish(self) -> list:
        rest = (OPEN if self._inside else "") + self._pending
        self._pending, self._inside = "", False
        return [Content(rest)] if rest else []


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that is a start of "<tool_call>"."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


PARSERS = {"hermes": HermesCalls}


def whole_reply(parser, text: str) -> list:
    """A whole reply's events. A named call's arguments that are not JSON (cut by max_tokens) make no call: a
    client would otherwise run the function with arguments like '{'."""
    if isinstance(parser, NamedCall):
        try:
            json.loads(text)
        except ValueError:
            return []
    return parser.feed(text) + parser.finish()


def joined(events: list) -> tuple[str | None, list[dict]]:
    """A whole reply's content (None when it is only calls, or empty) and its calls in OpenAI's shape."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, Arguments):
            calls[e.index]["function"]["arguments"] += e.text
    if calls and not content.strip():
        content = None
    return content, [calls[i] for i in sorted(calls)]


def parser_for(tools, template_source: str, template_renders_tools: bool, override: str | None = None):
    """What makes each choice's parser (a class or a function of no arguments), or None for a plain-text reply.

    For `auto` the format is the template's: Hermes where it writes `<tool_call>`, or where it does not render
    tools at all (nanoserve's tool prompt asks for Hermes then); `override` (--tool-call-parser) wins."""
    from nanoserve.tools.spec import ToolError

    if tools is None or tools.choice == "none":
        return None
    if tools.choice == "named":
        return lambda: NamedCall(tools.named)
    if tools.choice == "required":
        return RequiredCalls
    name = override or ("hermes" if not template_renders_tools or OPEN in template_source else None)
    if name is None:
        raise ToolError("tool_choice", "tool_choice 'auto' needs to read this model's tool calls, but its chat "
                                       f"template writes a format nanoserve has no parser for ({', '.join(PARSERS)} "
                                       "exist); send tool_choice 'required' or a named function (enforced on any "
                                       "model), or start the server with --tool-call-parser")
    return PARSERS[name]
