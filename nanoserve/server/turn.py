"""One assistant turn, for every API that speaks in turns: the conversation prepared as a chat request, and the
reply as a stream of events.

Chat Completions, Responses (responses_api.py) and Anthropic's Messages (messages_api.py) each translate their
request into a ChatCompletionRequest, so the three share the prompt (the chat template, the tool prompt), tool
calling, structured outputs, the prefix cache, disconnect handling and counters: for the same conversation and
greedy sampling they give the same text. `prepare_turn` admits the request to the engine; `turn_events` reads
the single reply (n = 1) as parser events, then one `TurnEnd`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from nanoserve.server.context import RouteContext, rendered_off_loop
from nanoserve.server.fanout import Fanout
from nanoserve.server.prompts import rendered_chat
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.tools.parsers import Arguments, CallStart, Content, parser_for


@dataclass
class PreparedTurn:
    """A chat request admitted to the engine: its fanout, the parser that reads tool calls out of its reply
    (None: plain text), and the prompt the chat template rendered."""

    body: ChatCompletionRequest
    fanout: Fanout
    parser: object | None
    prompt_text: str
    tokenizer: object
    rid: str


@dataclass(frozen=True)
class TurnEnd:
    """How the reply ended: the engine's finish reason ("stop", "length", "abort"), the stop string or token
    that ended it (None at an end-of-sequence token), whether it called tools, and its token counts."""

    finish_reason: str
    stop_reason: str | int | None
    called_tools: bool
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None  # prompt tokens read from the prefix cache (None: caching off)
    written_tokens: int | None = None  # prompt tokens written into the prefix cache (None: caching off)


async def prepare_turn(ctx: RouteContext, body: ChatCompletionRequest, prefix: str,
                       request: Request | None = None) -> PreparedTurn:
    """Admit `body` (checks, the template rendered off the event loop, given up if the client of `request`
    leaves) and open its engine request."""
    ctx.admit(body)
    ctx.check_template_trusted(body.chat_template)
    engine = ctx.host.serving()  # read per request: a restart may bring a new engine
    tokenizer = engine.tokenizer
    tools = body.tool_request()
    parser = parser_for(tools, tokenizer.template_source(body.chat_template, tools=[]) if tools else "",
                        bool(tools) and tokenizer.template_reads("tools", body.chat_template), ctx.tool_call_parser)
    text, ids = await rendered_off_loop(request, rendered_chat, body, tokenizer, tools, engine.max_model_len)
    limit = body.token_limit()
    params = body.sampling_params(limit if limit is not None else ctx.room_for(engine, ids), body.chat_logprobs())
    rid = ctx.request_id(body, prefix)
    fanout = await ctx.fanout(engine, [ids], params, rid, body)
    return PreparedTurn(body, fanout, parser, text, tokenizer, rid)


async def turn_events(turn: PreparedTurn, metrics) -> AsyncIterator[Content | CallStart | object]:
    """The reply as parser events (Content, CallStart, Arguments), as they come, then one TurnEnd. Closing the
    iterator early (the client left) aborts the request."""
    parser = turn.parser() if turn.parser is not None else None
    called = False
    async for choice, out in turn.fanout.outputs():
        c = choice.completion
        events = []
        if out.delta_text:
            events = parser.feed(out.delta_text) if parser is not None else [Content(out.delta_text)]
        if c.finish_reason is not None and parser is not None:
            events += parser.finish()
        for event in events:
            called |= isinstance(event, CallStart)
            yield event
        if c.finish_reason is not None:
            metrics.observe(out)
            prompt, made, cached, written = turn.fanout.token_counts()
            yield TurnEnd(c.finish_reason, c.stop_reason, called, prompt, made, cached, written)


@dataclass
class WholeTurn:
    """A reply read to its end: its text, its calls (each start with its arguments' JSON text) and its end."""

    text: str
    calls: list[tuple[CallStart, str]]
    end: TurnEnd


async def whole_turn(turn: PreparedTurn, metrics) -> WholeTurn:
    """Read the reply to its end (a whole, unstreamed answer)."""
    text, calls, end = [], {}, None
    async for event in turn_events(turn, metrics):
        if isinstance(event, Content):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls[event.index] = [event, ""]
        elif isinstance(event, Arguments):
            calls[event.index][1] += event.text
        else:
            end = event
    kept = [tuple(calls[i]) for i in sorted(calls) if _is_json(calls[i][1])]  # a call cut by max_tokens is none
    return WholeTurn("".join(text), kept, end)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False
