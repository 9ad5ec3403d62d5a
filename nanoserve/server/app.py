"""The OpenAI-compatible HTTP API over an EngineHost: completions, chat, models, tokenize, /health, /metrics.

The rule every route keeps: a request field is honoured, or refused with a 400 that says it is not supported and
what to do instead; it is never accepted and ignored. Fields outside OpenAI's and vLLM's request schemas are
ignored with one warning in the log, as vLLM does (protocol.py lists which is which). Every error, a 404 or 405
included, is an OpenAI-shaped body, and a refused or disconnected request holds no blocks: requests are
validated before they reach the engine, and a stream that ends early aborts its requests.

This module is the wiring: the app, its middleware (guard.py: the API key and the body's budget and deadline;
unicode_check.py: lone surrogates; refusals.py), the error handlers and the OpenAPI document. The routes are one module per concern, each an `add_routes(router,
ctx)` over the shared RouteContext (context.py): routes_ops (/health, /metrics, /reset_prefix_cache,
/version), routes_models, routes_tokens and routes_generate (completions and chat).
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.errors import NanoserveError
from nanoserve.server import (
    routes_generate,
    routes_messages,
    routes_models,
    routes_ops,
    routes_responses,
    routes_tokens,
)
from nanoserve.server.anthropic_errors import AnthropicErrors
from nanoserve.server.context import APIError, RouteContext, not_json_message, server_version
from nanoserve.server.context import error_response as _error
from nanoserve.server.disconnect import ClientGone
from nanoserve.server.guard import BODY_TIMEOUT_S, MAX_BODY_BYTES, Guard
from nanoserve.server.host import EngineFailure, EngineHost, HostStopped
from nanoserve.server.load import LoadTracker, ServerLoad
from nanoserve.server.metrics import Metrics
from nanoserve.server.openapi import install_openapi
from nanoserve.server.protocol import error_body
from nanoserve.server.refusals import CountRefusals
from nanoserve.server.unicode_check import LoneSurrogates

log = logging.getLogger("nanoserve.server")
# Each adds its routes to the app's own router, in this order (the OpenAPI document's). Not include_router: in
# FastAPI >= 0.165 that leaves one lazy _IncludedRouter in app.routes in place of the routes themselves.
ROUTE_MODULES = (routes_ops, routes_models, routes_tokens, routes_generate, routes_responses, routes_messages)


def build_app(host: EngineHost, model_name: str, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
              trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
              prompt_tokens_details: bool = False, body_timeout: float = BODY_TIMEOUT_S,
              force_include_usage: bool = False, return_tokens_as_token_ids: bool = False,
              per_request_metrics: bool = False) -> FastAPI:
    """`trust_request_chat_template`: a chat request may bring its own template (vLLM's flag of that name);
    a template is code the server renders, so without it such a request is refused. `tool_call_parser` names
    the format tool_choice 'auto' reads calls in, when the chat template's own is not the one to use.
    `prompt_tokens_details` off leaves usage.prompt_tokens_details (cached tokens) out, as vLLM does without
    --enable-prompt-tokens-details. The waiting queue's limit is the host's (EngineHost(max_waiting=...)): it
    is checked on the engine thread, where it cannot race. A request's whole body must arrive within
    `body_timeout` seconds (guard.py). `per_request_metrics`: vLLM's timing object on one-sequence answers
    (server/request_timing.py)."""
    app = FastAPI(title="nanoserve", version=server_version())
    load = LoadTracker()
    app.add_middleware(ServerLoad, tracker=load, named=lambda: _load_figures(host))  # inside the guard
    app.add_middleware(LoneSurrogates)  # it reads the body the guard hands on
    app.add_middleware(Guard, api_key=api_key, max_body=max_body, model_name=model_name, routes=app.router.routes,
                       body_timeout=body_timeout)
    app.add_middleware(AnthropicErrors)  # outside the guard: its 401 and 413 too
    app.add_middleware(CountRefusals, refusals=host.refusals)  # added last: outermost, it sees the guard's answers
    ctx = RouteContext(host, model_name, Metrics(host.stats, model_name, host.engine_stats), trust_request_chat_template,
                       tool_call_parser, prompt_tokens_details, force_include_usage, return_tokens_as_token_ids,
                       load, per_request_metrics)
    install_openapi(app, lambda: host.serving().max_model_len)
    _install_error_handlers(app)
    for module in ROUTE_MODULES:
        module.add_routes(app.router, ctx)
    return app


def _load_figures(host: EngineHost) -> dict[str, float]:
    """The ORCA report's figures, vLLM's two: KV-cache use and requests waiting (over every replica)."""
    stats = host.stats()
    return {"kv_cache_usage_perc": float(stats.kv.usage), "num_requests_waiting": float(stats.scheduler.waiting)}


# FastAPI's 400 for a JSON body json.loads could not decode (not UTF-8), without the reason
_BODY_UNREADABLE = "There was an error parsing the body"
# pydantic's type errors -> what the field takes, in JSON's words
_TAKES = {"bool_type": "true or false (a JSON boolean)", "bool_parsing": "true or false (a JSON boolean)",
          "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
          "list_type": "a list", "dict_type": "an object"}


def _invalid_request(exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint as a 400 that names the field and what it takes (FastAPI's own is a 422)."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is ("body", char offset): a position, not a field
        return _error(400, not_json_message(exc.body, first["loc"][-1], first.get("ctx", {}).get("error")))
    where = ".".join(_clipped(str(p)) for p in first.get("loc", ()) if p != "body")  # a dict key may be huge
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "string_too_long" and isinstance(first.get("input"), str):
        limit = first.get("ctx", {}).get("max_length")
        message = f"is {len(first['input']):,} characters; at most {limit} are taken: send a shorter one"
    if first.get("type") in _TAKES:
        came = first.get("input")
        shown = json.dumps(came)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        message = f"must be {_TAKES[first['type']]}, not {'the string ' if isinstance(came, str) else ''}{shown}"
    return _error(400, f"{where + ': ' if where else ''}{message}", param=where or None)


def _clipped(text: str, keep: int = 60) -> str:
    return text if len(text) <= keep else text[:keep - 3] + "..."


def _install_error_handlers(app: FastAPI) -> None:
    """Every error an OpenAI-shaped body, whoever raised it: a route, the engine, FastAPI or Starlette."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return _invalid_request(exc)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(NanoserveError)
    async def _refused(_, exc: NanoserveError):
        return _error(400, str(exc), param=getattr(exc, "field", None))

    @app.exception_handler(ClientGone)
    async def _gone(_, exc: ClientGone):
        # nobody is there to read it; 499 is the status proxies log for a client that closed the connection
        return _error(499, str(exc), "client_closed_request")

    @app.exception_handler(EngineFailure)
    async def _engine_failed(_, exc: EngineFailure):
        return _error(500, str(exc), "server_error")

    @app.exception_handler(HostStopped)
    async def _stopped(_, exc: HostStopped):
        return _error(503, str(exc), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        message = {404: f"no route {request.url.path}; see /docs for the routes this server has",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        if exc.status_code == 400 and exc.detail == _BODY_UNREADABLE:
            message = "request body is not valid JSON: it is not UTF-8 text; send the body as UTF-8 JSON"
        return JSONResponse(error_body(message, kinds.get(exc.status_code, "invalid_request_error"), None,
                                       exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        # what failed is for the operator's log; the caller gets an id to quote, never the internals
        error_id = uuid.uuid4().hex[:16]
        log.exception("request failed (error id %s)", error_id)
        return _error(500, f"the server failed on this request (error id {error_id}); the server's log has the "
                           "details under that id", "server_error")
