"""Anthropic's Messages API: POST /v1/messages (a whole message or its event stream) and
POST /v1/messages/count_tokens.

The request is translated into the chat request the other turn APIs share (messages_protocol.py, turn.py), so
the prompt, tools, structured outputs (output_config.format), the prefix cache and disconnect handling are the
chat route's. Errors answer in Anthropic's shape (anthropic_errors.py); the API key may come as `x-api-key`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from nanoserve.server.context import APIError, RouteContext, rendered_off_loop
from nanoserve.server.disconnect import unless_disconnected
from nanoserve.server.messages_api import MessagesResponder
from nanoserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from nanoserve.server.prompts import rendered_chat
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.turn import prepare_turn


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body: every refusal on these routes answers with one."""

    type: Literal["error"]
    error: AnthropicErrorInfo


class Message(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


_ERROR = {"model": AnthropicError}
# OpenAPI describes one server-sent event per item of a text/event-stream body: Anthropic's name each event
_SSE_EVENT = {"type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string", "description": "the event's type, as its data says"},
                             "data": {"type": "string", "description": "the event as JSON"}}}
ERRORS = {400: {**_ERROR, "description": "The request is refused: a bad value, or a field that is not supported"},
          401: {**_ERROR, "description": "Missing or wrong API key (x-api-key or Authorization: Bearer)"},
          404: {**_ERROR, "description": "The model named is not served here"},
          413: {**_ERROR, "description": "The request body is over the size limit"},
          503: {**_ERROR, "description": "The waiting queue is full, or the engine is restarting; retry shortly"}}
STREAMED = {200: {"model": Message, "description": "One message, or with stream: true Anthropic's server-sent "
                                                   "events (message_start ... message_stop)",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def translated(body) -> ChatCompletionRequest | dict:
    """The chat request (or, for count_tokens, its fields) of a Messages body; a part that cannot be one is a
    400 saying which."""
    try:
        return body.to_chat() if isinstance(body, MessagesRequest) else body.chat_fields()
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("Value error, ")) from None


async def create(ctx: RouteContext, body: MessagesRequest, request: Request):
    ctx.admit(body)
    turn = await prepare_turn(ctx, translated(body), "msg", request)
    responder = MessagesResponder(turn, ctx.model_name, ctx.metrics)
    return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())


async def count_tokens(ctx: RouteContext, body: CountTokensRequest, request: Request) -> dict:
    ctx.admit(body)
    chat = ChatCompletionRequest.model_validate({**translated(body), "model": body.model})
    engine = ctx.host.serving()
    _, ids = await rendered_off_loop(request, rendered_chat, chat, engine.tokenizer, chat.tool_request(), None)
    return {"input_tokens": len(ids)}


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    @routes.post("/v1/messages", responses={**ERRORS, **STREAMED},
                 summary="Anthropic's Messages API: a reply to the conversation, whole or streamed")
    async def messages(body: MessagesRequest, request: Request):
        return await create(ctx, body, request)

    @routes.post("/v1/messages/count_tokens", responses={**ERRORS, 200: {"model": TokenCount}},
                 summary="The prompt tokens a Messages request would send (Anthropic's count_tokens)")
    async def messages_count_tokens(body: CountTokensRequest, request: Request):
        return await count_tokens(ctx, body, request)
