"""OpenAI's Responses answers: a whole response object, or its stream of events (response.created,
response.in_progress, output items with their content parts and text deltas, function-call argument deltas,
response.completed or response.incomplete), each numbered by `sequence_number`, from one turn's events (turn.py).

The output is a message item (output_text) when the reply has text, and a function_call item per call. A reply cut
by max_output_tokens is `incomplete` with that reason. Usage counts input tokens (the cached ones among them) and
output tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from nanoserve.server.responses import chat_logprobs, token_namer
from nanoserve.server.responses_protocol import ResponsesRequest, item_id
from nanoserve.server.turn import PreparedTurn, TurnEnd, turn_events, whole_turn
from nanoserve.tools.parsers import CallStart, Content


def usage_of(end: TurnEnd) -> dict:
    return {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens or 0},
            "output_tokens": end.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.prompt_tokens + end.output_tokens}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class OutputLogprobs:
    """The reply's token logprobs in the Responses shape (include ["message.output_text.logprobs"]): all of them
    for the output text, and those not yet sent for each streamed delta."""

    def __init__(self, turn: PreparedTurn):
        self.choice = turn.fanout.choices[0]
        self.name = token_namer(turn.tokenizer, bool(turn.body.return_tokens_as_token_ids))
        self.sent = 0

    def every(self) -> list[dict]:
        return chat_logprobs(self.choice.completion.logprobs.entries(), self.name)["content"]

    def fresh(self) -> list[dict]:
        entries = self.choice.completion.logprobs.entries(self.sent)
        self.sent += len(entries)
        return chat_logprobs(entries, self.name)["content"]


class ResponsesResponder:
    """`done(response, output items)` is called once the response is complete: the store keeps it, or says it
    did not (False: not asked to, or over the store's bound for one response), and the response says `store`
    false."""

    def __init__(self, body: ResponsesRequest, turn: PreparedTurn, model: str, metrics,
                 done: Callable[[dict, list[dict]], bool]):
        self.body, self.turn, self.model, self.metrics, self.done = body, turn, model, metrics, done
        self.id = item_id("resp")
        self.created = int(time.time())
        self.logprobs = OutputLogprobs(turn) if body.wants_logprobs() else None

    def response(self, status: str, output: list[dict], end: TurnEnd | None) -> dict:
        """The response object as it stands (in_progress while streaming, then completed or incomplete)."""
        body, chat = self.body, self.turn.body
        tools = [{"type": "function", **t["function"]} for t in (chat.model_dump()["tools"] or [])]
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else \
            {"format": {"type": "text"}}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": chat.temperature, "text": text,
            "tool_choice": _tool_choice(body.tool_choice), "tools": tools, "top_p": chat.top_p,
            "top_logprobs": body.top_logprobs, "truncation": "disabled", "usage": usage_of(end) if end is not None else None, "user": body.user,
            "metadata": body.metadata or {}, "background": bool(body.background),
        }

    def _finished(self, output: list[dict], end: TurnEnd) -> dict:
        status = "incomplete" if end.finish_reason == "length" else "completed"
        response = self.response(status, output, end)
        if self.body.enable_response_messages:
            response |= self._raw_messages()
        response["store"] = self.done(response, output)
        return response

    def _raw_messages(self) -> dict:
        """vLLM's enable_response_messages: the prompt as the template rendered it and the reply as the model
        wrote it (tool calls' text included), each with its token ids, which are the truth where the two differ."""
        fanout, completion = self.turn.fanout, self.turn.fanout.choices[0].completion
        raw = "raw_message_tokens"
        return {"input_messages": [{"message": self.turn.prompt_text, "tokens": list(fanout.prompts[0]), "type": raw}],
                "output_messages": [{"message": completion.text, "tokens": list(completion.token_ids), "type": raw}]}

    async def whole(self) -> dict:
        reply = await whole_turn(self.turn, self.metrics)
        status = "incomplete" if reply.end.finish_reason == "length" else "completed"
        logprobs = self.logprobs.every() if self.logprobs is not None else None
        output = [_message_item(item_id("msg"), status, [text_part(reply.text, logprobs)])] \
            if reply.text or not reply.calls else []
        output += [{**_call_item(start), "arguments": arguments, "status": "completed"}
                   for start, arguments in reply.calls]
        return self._finished(output, reply.end)

    def stream(self) -> StreamingResponse:
        return responses_sse(self.events())

    async def events(self) -> AsyncIterator[dict]:
        """The response's events, not yet numbered (responses_sse, or a background stream's log, numbers them)."""
        yield {"type": "response.created", "response": self.response("in_progress", [], None)}
        yield {"type": "response.in_progress", "response": self.response("in_progress", [], None)}
        items = _OutputItems()
        async for event in turn_events(self.turn, self.metrics):
            if isinstance(event, TurnEnd):
                status = "incomplete" if event.finish_reason == "length" else "completed"
                for out in items.close(status, self.logprobs.every() if self.logprobs is not None else None):
                    yield out
                response = self._finished(items.output, event)
                yield {"type": f"response.{status}", "response": response}
                return
            fresh = self.logprobs.fresh() if self.logprobs is not None and isinstance(event, Content) else None
            for out in items.add(event, fresh):
                yield out


class _OutputItems:
    """The output items of a streamed response as the turn's events open, fill and close them."""

    def __init__(self):
        self.output: list[dict] = []  # the items closed so far, as the final response lists them
        self.open: dict | None = None  # the item being streamed
        self.text = ""

    @property
    def index(self) -> int:
        return len(self.output)

    def add(self, event, logprobs: list[dict] | None = None) -> list[dict]:
        """The events that stream `event`; a text delta carries the logprobs of its tokens when asked for."""
        if isinstance(event, Content):
            out = [] if self.open is not None and self.open["type"] == "message" else self._open_message()
            self.text += event.text
            return out + [{"type": "response.output_text.delta", "item_id": self.open["id"],
                           "output_index": self.index, "content_index": 0, "delta": event.text,
                           "logprobs": logprobs or []}]
        if isinstance(event, CallStart):
            out = self.close("completed") if self.open is not None else []
            self.open = {**_call_item(event), "status": "in_progress"}
            return out + [{"type": "response.output_item.added", "output_index": self.index, "item": dict(self.open)}]
        if not event.text:
            return []
        self.open["arguments"] += event.text
        return [{"type": "response.function_call_arguments.delta", "item_id": self.open["id"],
                 "output_index": self.index, "delta": event.text}]

    def _open_message(self) -> list[dict]:
        out = self.close("completed") if self.open is not None else []
        self.open, self.text = _message_item(item_id("msg"), "in_progress", []), ""
        return out + [{"type": "response.output_item.added", "output_index": self.index, "item": dict(self.open)},
                      {"type": "response.content_part.added", "item_id": self.open["id"], "output_index": self.index,
                       "content_index": 0, "part": text_part("")}]

    def close(self, status: str, logprobs: list[dict] | None = None) -> list[dict]:
        """End the open item (a message's text, with all its tokens' `logprobs` when asked for; a call's
        arguments), or open and end an empty message when the reply had nothing at all."""
        item = self.open
        if item is None and self.output:
            return []
        out = self._open_message() if item is None else []
        item, index = self.open, self.index
        self.open = None
        if item["type"] == "message":
            part = text_part(self.text, logprobs)
            done = _message_item(item["id"], status, [part])
            out += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                     "content_index": 0, "text": self.text, "logprobs": logprobs or []},
                    {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                     "content_index": 0, "part": part}]
        else:
            done = {**item, "status": "completed"}
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        self.output.append(done)
        return out + [{"type": "response.output_item.done", "output_index": index, "item": done}]


def _message_item(mid: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def _call_item(start: CallStart) -> dict:
    return {"type": "function_call", "id": item_id("fc"), "call_id": start.id, "name": start.name, "arguments": ""}


def _tool_choice(choice) -> str | dict:
    return "auto" if choice is None else choice


def responses_sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """The Responses API's server-sent events: `event: <type>`, then the event with its sequence_number."""
    async def body():
        number = 0
        try:
            async for event in events:
                event = {**event, "sequence_number": number}
                number += 1
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # headers are gone: say so in the stream itself
            error = {"type": "error", "code": "server_error", "message": str(e), "param": None,
                     "sequence_number": number}
            yield f"event: error\ndata: {json.dumps(error)}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
