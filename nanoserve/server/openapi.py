"""The OpenAPI document: OpenAI-shaped error bodies for every refusal, SSE as a second 200 body, live limits.

FastAPI documents validation failures as 422 with its own body; this server answers them with a 400 and an
OpenAI error body, so the document says that instead. The token limits come from the engine serving now.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from nanoserve.server.protocol import ErrorResponse

_ERROR = {"model": ErrorResponse}
ERRORS = {
    400: {**_ERROR, "description": "The request is refused: a bad value, or a field that is not supported"},
    401: {**_ERROR, "description": "Missing or wrong API key (when the server was started with --api-key)"},
    404: {**_ERROR, "description": "The model named is not served here"},
    413: {**_ERROR, "description": "The request body is over the size limit"},
    500: {**_ERROR, "description": "The server failed on this request"},
    503: {**_ERROR, "description": "The waiting queue is full, or the engine is restarting; retry shortly"},
}
# OpenAPI describes one server-sent event per item of a text/event-stream body
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"}}}

NOT_KEPT = {**_ERROR, "description": "No such request is live or among the latest finished"}


def ok(model) -> dict:
    """A 200 with a JSON body of `model`."""
    return {200: {"model": model}}


def streamed(model) -> dict:
    """A 200 that is one JSON body of `model`, or with stream: true server-sent events ending in [DONE]."""
    return {200: {"model": model, "description": "One JSON body, or with stream: true server-sent events ending "
                                                 "in [DONE]", "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def install_openapi(app: FastAPI, max_model_len: Callable[[], int]) -> None:
    """Serve the document with 400 in place of FastAPI's 422, and max_tokens bounded by the live max_model_len."""
    base: dict = {}

    def openapi() -> dict:
        if not base:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            base.update(schema)
        limit = max_model_len() - 1
        for model, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                             ("ChatCompletionRequest", "max_completion_tokens")):
            prop = base["components"]["schemas"].get(model, {}).get("properties", {}).get(field, {})
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "integer":
                    branch["maximum"] = limit
        return base

    app.openapi = openapi
