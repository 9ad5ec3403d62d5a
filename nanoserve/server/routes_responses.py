"""OpenAI's Responses API: POST /v1/responses (a whole response or its event stream), GET and DELETE
/v1/responses/{id} (the stored ones, response_store.py), GET /v1/responses/{id}/input_items.

The request is translated into the chat request the other turn APIs share (responses_protocol.py, turn.py), so the
prompt, tools, structured outputs (text.format), the prefix cache and disconnect handling are the chat route's.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from nanoserve.errors import shown
from nanoserve.server.context import APIError, RouteContext
from nanoserve.server.disconnect import unless_disconnected
from nanoserve.server.openapi import ERRORS
from nanoserve.server.response_store import ResponseStore, Stored, json_size
from nanoserve.server.responses_api import ResponsesResponder
from nanoserve.server.responses_protocol import ResponsesRequest
from nanoserve.server.turn import prepare_turn

_SSE_EVENT = {"type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string", "description": "the event's type, as its data says"},
                             "data": {"type": "string", "description": "the event as JSON, with its sequence_number"}}}


class Response(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class Deleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItems(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


STREAMED = {200: {"model": Response, "description": "One response, or with stream: true server-sent events "
                                                    "(response.created ... response.completed)",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}
NOT_STORED = {404: {**ERRORS[404], "description": "No such response is stored (never stored, deleted, or past "
                                                  "the store's age or size)"}}


def _stored(store: ResponseStore, response_id: str) -> Stored:
    kept = store.get(response_id)
    if kept is None:
        raise APIError(404, f"no stored response {shown(response_id)}: responses are kept in memory for an hour, "
                            f"within the store's bounds ({store.max_kept:,} responses, {store.max_bytes // 2**20} "
                            "MiB), and only with store true", "not_found_error", "response_id")
    return kept


async def create(ctx: RouteContext, store: ResponseStore, body: ResponsesRequest, request: Request):
    ctx.admit(body)
    prior = None if body.previous_response_id is None else _stored(store, body.previous_response_id)
    history = prior.conversation if prior is not None else []
    try:
        chat = body.to_chat(history)
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("Value error, ")) from None
    items = body.input_items()
    asked, asked_bytes = history + items, store.conversation_bytes(prior, items)
    if body.store is not False and asked_bytes > store.max_entry_bytes:
        raise APIError(400, f"store keeps a response with its conversation up to {store.max_entry_bytes:,} bytes "
                            f"(as JSON), and this conversation is already {asked_bytes:,}: send store false to "
                            "answer without keeping it, or start a shorter conversation", param="store")
    turn = await prepare_turn(ctx, chat, "resp", request)
    owner = body.user or body.safety_identifier or ""

    def done(response: dict, output: list[dict]) -> bool:
        if body.store is False:
            return False
        return store.put(response, asked + output, owner, asked_bytes + json_size(output))

    responder = ResponsesResponder(body, turn, ctx.model_name, ctx.metrics, done)
    return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    store = ResponseStore()  # the app's: an engine restart keeps it

    @routes.post("/v1/responses", responses={**ERRORS, **STREAMED},
                 summary="OpenAI's Responses API: a reply to the input (and a stored conversation), whole or streamed")
    async def responses(body: ResponsesRequest, request: Request):
        return await create(ctx, store, body, request)

    @routes.get("/v1/responses/{response_id}", responses={**ERRORS, **NOT_STORED, 200: {"model": Response}},
                summary="A stored response")
    async def get_response(response_id: str, request: Request):
        _only_query(request, ())
        return _stored(store, response_id).response

    @routes.delete("/v1/responses/{response_id}", responses={**ERRORS, **NOT_STORED, 200: {"model": Deleted}},
                   summary="Forget a stored response")
    async def delete_response(response_id: str):
        _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @routes.post("/v1/responses/{response_id}/cancel", responses={**ERRORS, **NOT_STORED},
                 summary="Cancel a background response (vLLM's and OpenAI's route): background mode is not served, "
                         "so every stored response is complete, and cancelling one is a 400 that says so")
    async def cancel_response(response_id: str):
        kept = _stored(store, response_id)
        raise APIError(400, f"response {shown(response_id)} is {kept.response.get('status')}: only a background "
                            "response can be cancelled, and background mode is not served here (a response is "
                            "answered while its request waits; close the request to stop it)", param="response_id")

    @routes.get("/v1/responses/{response_id}/input_items",
                responses={**ERRORS, **NOT_STORED, 200: {"model": InputItems}},
                summary="The input items of a stored response (the conversation before its output), a page at a "
                        "time: order (desc, the default, or asc), limit (1 to 100, default 20), after (an item id)")
    async def input_items(response_id: str, request: Request, order: Literal["asc", "desc"] = "desc",
                          limit: int = Query(default=20, ge=1, le=100), after: str | None = None):
        _only_query(request, ("order", "limit", "after"))
        return items_page(_stored(store, response_id), order, limit, after)


def _only_query(request: Request, known: tuple[str, ...]) -> None:
    """OpenAI's other query parameters (stream, starting_after, include) ask for what is not served here: a 400,
    never ignored. An empty include asks nothing."""
    for name, value in request.query_params.multi_items():
        if name not in known and not (name in ("include", "include[]") and not value):
            raise APIError(400, f"the query parameter {name!r} is not supported here (a stored response is read "
                                "whole, with no extra data); leave it out", param=name)


def items_page(kept, order: str, limit: int, after: str | None) -> dict:
    """One page of a stored response's input items, as OpenAI lists them (each with an id)."""
    items = kept.conversation[:len(kept.conversation) - len(kept.response["output"])]
    data = [{"id": item.get("id") or f"item_{i}", **item} for i, item in enumerate(items)]
    if order == "desc":
        data.reverse()
    if after is not None:
        ids = [item["id"] for item in data]
        if after not in ids:
            raise APIError(400, f"after names {shown(after)}, which is not an input item of this response",
                           param="after")
        data = data[ids.index(after) + 1:]
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}
