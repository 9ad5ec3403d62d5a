"""Anthropic's Messages answers: a whole message, or its stream of events (message_start, content blocks with
text_delta / input_json_delta, message_delta with the stop reason and usage, message_stop), from one turn's
events (turn.py).

stop_reason: `tool_use` when the reply called tools, `max_tokens` at the token limit, `stop_sequence` (with the
sequence) when a stop string ended it, else `end_turn`. Usage counts as Anthropic does: `input_tokens` are the
prompt tokens the prefix cache did not hold, `cache_read_input_tokens` the ones it did.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from nanoserve.server.turn import PreparedTurn, TurnEnd, turn_events, whole_turn
from nanoserve.tools.parsers import CallStart, Content


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def stop_of(end: TurnEnd) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if end.called_tools and end.finish_reason == "stop":
        return "tool_use", None
    if end.finish_reason == "stop" and isinstance(end.stop_reason, str):
        return "stop_sequence", end.stop_reason
    return ("max_tokens" if end.finish_reason == "length" else "end_turn"), None


def usage_of(prompt: int, output: int, cached: int | None, written: int | None = None) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens neither read from nor written into the prefix cache,
    so the three input counts add up to the prompt."""
    read, created = cached or 0, written or 0
    return {"input_tokens": prompt - read - created, "output_tokens": output,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": created}


def tool_input(arguments: str) -> dict | None:
    """A call's arguments as the tool_use block's input object; None when they are not a JSON object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class MessagesResponder:
    def __init__(self, turn: PreparedTurn, model: str, metrics):
        self.turn, self.model, self.metrics = turn, model, metrics
        self.id = message_id()

    def _message(self, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    async def whole(self) -> dict:
        reply = await whole_turn(self.turn, self.metrics)
        content, joined, end = [], reply.text, reply.end
        for start, arguments in reply.calls:
            data = tool_input(arguments)
            if data is None:  # not an object the client could run: kept as text, never dropped
                joined += arguments
            else:
                content.append({"type": "tool_use", "id": _tool_use_id(start.id), "name": start.name, "input": data})
        if joined.strip() or not content:
            content.insert(0, {"type": "text", "text": joined})
        return self._message(content, stop_of(end), usage_of(end.prompt_tokens, end.output_tokens, end.cached_tokens, end.written_tokens))

    def stream(self) -> StreamingResponse:
        return anthropic_sse(self._events())

    async def _events(self) -> AsyncIterator[dict]:
        prompt = len(self.turn.fanout.prompts[0])
        yield {"type": "message_start", "message": self._message([], (None, None), usage_of(prompt, 0, None))}
        yield {"type": "ping"}
        blocks = _Blocks()
        async for event in turn_events(self.turn, self.metrics):
            if isinstance(event, TurnEnd):
                for block in blocks.close():
                    yield block
                stop = stop_of(event)
                yield {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                       "usage": usage_of(event.prompt_tokens, event.output_tokens, event.cached_tokens,
                                         event.written_tokens)}
                yield {"type": "message_stop"}
                return
            for block in blocks.add(event):
                yield block


class _Blocks:
    """The content blocks of a streamed message: text goes to an open text block, each call opens a tool_use
    block whose arguments stream as input_json_delta."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "text", "tool_use" or None
        self.call: int | None = None  # the call index of the open tool_use block

    def add(self, event) -> list[dict]:
        if isinstance(event, Content):
            out = [] if self.open == "text" else self._start({"type": "text", "text": ""}, "text")
            return out + [{"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": event.text}}]
        if isinstance(event, CallStart):
            self.call = event.index
            return self._start({"type": "tool_use", "id": _tool_use_id(event.id), "name": event.name, "input": {}},
                               "tool_use")
        if not event.text:
            return []
        return [{"type": "content_block_delta", "index": self.index,
                 "delta": {"type": "input_json_delta", "partial_json": event.text}}]

    def _start(self, block: dict, kind: str) -> list[dict]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


def _tool_use_id(call_id: str) -> str:
    """Anthropic's tool_use ids read toolu_...; the parser's call ids, call_..."""
    return "toolu_" + call_id.removeprefix("call_")


def anthropic_sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Anthropic's server-sent events: `event: <type>` then its data; a failure mid-stream is an error event."""
    async def body():
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # headers are gone: say so in the stream itself
            error = {"type": "error", "error": {"type": "api_error", "message": str(e)}}
            yield f"event: error\ndata: {json.dumps(error)}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
