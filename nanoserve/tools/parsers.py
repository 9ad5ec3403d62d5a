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
- `MistralCalls` (auto): text, then `[TOOL_CALLS]` and the calls, a JSON array (Mistral's v3 templates) or
  `name[ARGS]{...}` after each `[TOOL_CALLS]` (v11 tokenizers); ids of 9 letters and digits, the only ones
  Mistral's templates take back in a history.
- `Llama3JsonCalls` (auto): a reply that opens with a JSON object (after Llama 3.1's `<|python_tag|>`, if any) is
  calls, `{"name": ..., "parameters": {...}}` objects separated by `;`; any other reply is text.
"""

from __future__ import annotations

import json
import secrets
import string
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
            keep = _partial(self._pending, OPEN)
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


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """9 letters and digits: Mistral's chat templates refuse any other id when the call comes back in a history."""
    return "".join(secrets.choice(ALNUM) for _ in range(9))


class MistralCalls:
    """Content up to `[TOOL_CALLS]`, calls after it. The calls are read whole when the reply ends (a JSON array is
    only known to be calls once it parses): if any of them does not parse, the text after the tag comes back as
    content, as the model wrote it."""

    forced = False

    def __init__(self):
        self._pending, self._calls_text = "", None

    def feed(self, text: str) -> list:
        if self._calls_text is not None:
            self._calls_text += text
            return []
        self._pending += text
        start = self._pending.find(TOOL_CALLS)
        if start >= 0:
            content, self._calls_text = self._pending[:start], self._pending[start + len(TOOL_CALLS):]
            self._pending = ""
            return [Content(content)] if content else []
        keep = _partial(self._pending, TOOL_CALLS)
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return [Content(out)] if out else []

    def finish(self) -> list:
        if self._calls_text is None:
            rest, self._pending = self._pending, ""
            return [Content(rest)] if rest else []
        text, self._calls_text = self._calls_text, None
        calls = _mistral_calls(text)
        return [Content(TOOL_CALLS + text)] if calls is None else _call_events(calls, mistral_call_id)


def _mistral_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call after the first `[TOOL_CALLS]`, or None unless every one parses."""
    calls = []
    for piece in (p.strip() for p in text.split(TOOL_CALLS)):
        if not piece:
            continue
        try:
            if ARGS in piece:  # v11: name[ARGS]{...}
                name, arguments = piece.split(ARGS, 1)
                calls.append(_named(name.strip(), json.loads(arguments)))
                continue
            value = json.loads(piece)
            calls += [_named(v["name"], v.get("arguments", {})) for v in (value if isinstance(value, list) else [value])]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    return calls or None


def _call_events(calls: list[tuple[str, str]], make_id) -> list:
    """A whole reply's (name, arguments JSON) calls as events, each with an id from `make_id`."""
    events = []
    for index, (name, arguments) in enumerate(calls):
        events += [CallStart(index, make_id(), name), Arguments(index, arguments)]
    return events


def _named(name, arguments) -> tuple[str, str]:
    """A call's name and its arguments as JSON text; TypeError unless the name is a string and the arguments an
    object (or JSON text of one)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise TypeError
    return name, json.dumps(arguments, ensure_ascii=False)


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonCalls:
    """A reply whose first text (past whitespace and `<|python_tag|>`) is `{` is read as calls when it ends, JSON
    objects with "name" and "parameters" (or "arguments") separated by `;`; a reply that does not parse so comes
    back as content whole. Any other reply is content, streamed as it comes."""

    forced = False

    def __init__(self):
        self._head, self._mode = "", None  # mode: None undecided, "text", "calls"

    def feed(self, text: str) -> list:
        if self._mode == "text":
            return [Content(text)] if text else []
        self._head += text
        if self._mode is None:
            lead = _past_tag(self._head).lstrip()
            if not lead or (PYTHON_TAG.startswith(lead) and len(lead) < len(PYTHON_TAG)):
                return []  # nothing yet, or what may still be the tag
            self._mode = "calls" if lead.startswith("{") else "text"
            if self._mode == "text":
                head, self._head = self._head, ""
                return [Content(head)]
        return []

    def finish(self) -> list:
        head, mode, self._head, self._mode = self._head, self._mode, "", None
        calls = _llama3_calls(head) if mode == "calls" else None
        if calls is None:
            return [Content(head)] if head else []
        return _call_events(calls, call_id)


def _past_tag(text: str) -> str:
    """`text` past its leading whitespace and Llama 3.1's `<|python_tag|>`, if it opens with one."""
    text = text.lstrip()
    return text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """Each `{"name", "parameters"}` object of a reply, `;` between them, or None unless all of it parses."""
    text = _past_tag(text).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while True:
            while at < len(text) and (text[at].isspace() or (text[at] == ";" and calls)):
                at += 1
            if at == len(text):
                return calls or None
            value, at = decoder.raw_decode(text, at)
            arguments = value.get("parameters", value.get("arguments", {})) if isinstance(value, dict) else None
            calls.append(_named(value.get("name") if isinstance(value, dict) else None, arguments))
    except (ValueError, TypeError):
        return None


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS = {"hermes": HermesCalls, "mistral": MistralCalls, "llama3_json": Llama3JsonCalls}
# what in a chat template's source says which format its model writes calls in (auto's choice without an override)
TEMPLATE_MARKS = (("hermes", (OPEN,)), ("mistral", (TOOL_CALLS,)),
                  ("llama3_json", (PYTHON_TAG, '"parameters": dictionary of argument name')))


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

    For `auto` the format is the template's (TEMPLATE_MARKS: Hermes `<tool_call>`, Mistral's `[TOOL_CALLS]`,
    Llama 3.1's JSON calls), Hermes where it does not render tools at all (nanoserve's tool prompt asks for Hermes
    then); `override` (--tool-call-parser) wins. A strict function under auto is enforced by a grammar of Hermes
    calls, so with another format it is refused rather than forced into calls the parser would not read."""
    from nanoserve.tools.spec import ToolError

    if tools is None or tools.choice == "none":
        return None
    if tools.choice == "named":
        return lambda: NamedCall(tools.named)
    if tools.choice == "required":
        return RequiredCalls
    name = override or ("hermes" if not template_renders_tools else template_format(template_source))
    if name is None:
        raise ToolError("tool_choice", "tool_choice 'auto' needs to read this model's tool calls, but its chat "
                                       f"template writes a format nanoserve has no parser for ({', '.join(PARSERS)} "
                                       "exist); send tool_choice 'required' or a named function (enforced on any "
                                       "model), or start the server with --tool-call-parser")
    if name != "hermes" and any(f.strict for f in tools.functions):
        raise ToolError("tools", f"a strict function under tool_choice 'auto' is enforced as Hermes <tool_call> "
                                 f"blocks, but this model writes its calls in the {name} format; send tool_choice "
                                 "'required' or a named function (strict is enforced there), or drop strict")
    return PARSERS[name]


def template_format(template_source: str) -> str | None:
    """The call format a chat template writes (the first of TEMPLATE_MARKS it holds), or None."""
    return next((name for name, marks in TEMPLATE_MARKS if any(m in template_source for m in marks)), None)
