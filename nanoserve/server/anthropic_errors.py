"""Errors in Anthropic's shape on Anthropic's routes: `{"type": "error", "error": {"type": ..., "message": ...}}`.

Every refusal on the server is written once, in OpenAI's shape (the guard's 401 and 413, a route's 400, a
validation error, a 503 while the engine restarts); this pure ASGI middleware rewrites those answers on
/v1/messages paths, so the anthropic SDK raises the error class of the status with the server's message.
"""

from __future__ import annotations

import json

PREFIX = "/v1/messages"
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": KINDS.get(status, "api_error"), "message": message}}


class AnthropicErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewriting(message):
            nonlocal start
            if message["type"] == "http.response.start":
                is_json = dict(message.get("headers") or ()).get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    start = message  # held until its body is whole
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = _rewritten(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers") or () if k != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewriting)


def _rewritten(status: int, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    return json.dumps(anthropic_error(status, message)).encode()
