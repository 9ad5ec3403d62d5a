"""OpenAI's Responses API: POST /v1/responses (a whole response or its event stream, or either in the background:
background.py), GET and DELETE /v1/responses/{id} (the stored ones, response_store.py; a background stream read
again), POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items.

The request is translated into the chat request the other turn APIs share (responses_protocol.py, turn.py), so the
prompt, tools, structured outputs (text.format), the prefix cache and disconnect handling are the chat route's.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from nanoserve.errors import shown
from nanoserve.server.background import ACTIVE, BackgroundRuns, sse_of
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
        raise APIError(404, f"response {shown(response_id)} not found: responses are kept in memory for an hour, "
                            f"within the store's bounds ({store.max_kept:,} responses, {store.max_bytes // 2**20} "
                            "MiB), and only with store true", "not_found_error", "response_id")
    return kept


async def create(ctx: RouteContext, runs: BackgroundRuns, body: ResponsesRequest, request: Request):
    store = runs.store
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

    def keep(response: dict, output: list[dict]) -> bool:
        return store.put(response, asked + output, owner, asked_bytes + json_size(output))

    def done(response: dict, output: list[dict]) -> bool:
        if body.store is False:
            return False
        kept = keep(response, output)
        if not kept and body.background:  # its queued state must not stand for it
            keep(_failed(response, f"the response is larger than the store keeps ({store.max_entry_bytes:,} "
                                   "bytes with its conversation)"), [])
        return kept

    responder = ResponsesResponder(body, turn, ctx.model_name, ctx.metrics, done)
    if body.background:
        return _in_background(runs, responder, keep, bool(body.stream))
    return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())


def _failed(response: dict, why: str) -> dict:
    return {**response, "status": "failed", "output": [], "error": {"code": "server_error", "message": why}}


def _in_background(runs: BackgroundRuns, responder: ResponsesResponder, keep, streamed: bool):
    """Store the response queued and run it as a task; answer the queued response, or the stream's events."""
    queued = responder.response("queued", [], None)
    keep(queued, [])

    def failed(why: str) -> None:
        keep(_failed(responder.response("failed", [], None), why), [])

    if streamed:
        keep(responder.response("in_progress", [], None), [])
        log = runs.start_stream(responder.id, responder.events(), failed)
        return StreamingResponse(sse_of(log.read()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def whole():
        keep(responder.response("in_progress", [], None), [])
        await responder.whole()

    runs.start_whole(responder.id, whole, failed)
    return queued


def add_routes(routes: APIRouter, ctx: RouteContext) -> None:
    store = ResponseStore()  # the app's: an engine restart keeps it
    runs = BackgroundRuns(store)

    @routes.post("/v1/responses", responses={**ERRORS, **STREAMED},
                 summary="OpenAI's Responses API: a reply to the input (and a stored conversation), whole or streamed")
    async def responses(body: ResponsesRequest, request: Request):
        return await create(ctx, runs, body, request)

    @routes.get("/v1/responses/{response_id}", responses={**ERRORS, **NOT_STORED, **STREAMED},
                summary="A stored response as it stands (a background one while it runs); with stream=true, a "
                        "background stream's events again, all or those after starting_after")
    async def get_response(response_id: str, request: Request, stream: bool = False,
                           starting_after: int | None = Query(default=None, ge=0)):
        _only_query(request, ("stream", "starting_after"))
        kept = _stored(store, response_id)
        if not stream:
            if starting_after is not None:
                raise APIError(400, "starting_after picks up a stream: send stream=true too", param="starting_after")
            return kept.response
        log = runs.logs.get(response_id)
        if log is None:
            raise APIError(400, f"response {shown(response_id)} was not streamed in the background, so it has no "
                                "events kept to stream again; read it whole (without stream)", param="stream")
        return StreamingResponse(sse_of(log.read(starting_after)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @routes.delete("/v1/responses/{response_id}", responses={**ERRORS, **NOT_STORED, 200: {"model": Deleted}},
                   summary="Forget a stored response")
    async def delete_response(response_id: str):
        _stored(store, response_id)
        await runs.cancel(response_id)  # a background one still running stops: nobody could read it
        store.delete(response_id)
        runs.logs.pop(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    @routes.post("/v1/responses/{response_id}/cancel", responses={**ERRORS, **NOT_STORED},
                 summary="Cancel a background response while it is queued or in progress: its request is aborted "
                         "and it is stored cancelled")
    async def cancel_response(response_id: str):
        kept = _stored(store, response_id)
        if kept.response.get("status") not in ACTIVE or not await runs.cancel(response_id):
            kept = _stored(store, response_id)  # as it stands now (it may have just finished)
            raise APIError(400, f"response {shown(response_id)} is {kept.response.get('status')}: only a background "
                                "response still queued or in progress can be cancelled (one answered in the "
                                "foreground is stopped by closing its request)", param="response_id")
        cancelled = {**kept.response, "status": "cancelled"}
        store.put(cancelled, kept.conversation, kept.owner, kept.conversation_bytes)
        return cancelled

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
