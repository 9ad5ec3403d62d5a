"""The API key, the body's size and its deadline, checked before any route parses a request (a pure ASGI
middleware)."""

from __future__ import annotations

import secrets

from nanoserve.server.access import KEYED, access
from nanoserve.server.body import (
    BODYLESS_BYTES,
    BodyRefused,
    ClientLeft,
    declared_length,
    read_body,
    replaying,
    sends_body,
    takes_body,
)
from nanoserve.server.context import error_response
from nanoserve.tracing import TRACE_HEADERS, TraceOrigin, current_origin, operation_of

MAX_BODY_BYTES = 4 * 2**20
BODY_TIMEOUT_S = 30.0


class Guard:
    """API key and body, checked before a route parses anything (a pure ASGI middleware).

    The key is asked of every route but those access.WITHOUT_KEY lists, before a byte of the body is read;
    whether the caller sent it is left in the request's state (`authorized`) for the routes that answer both,
    less without it (/health).

    The body is counted as it arrives, not trusted from Content-Length: a chunked upload has none. Its budget is
    `max_body` on a route that takes a body and the caller may use, body.BODYLESS_BYTES anywhere else (so a
    caller without the key buffers next to nothing); a declared length over it is refused before reading, and
    one byte over, the request is answered 413. The whole body must arrive within `body_timeout` seconds, or
    the answer is 408. Every such refusal closes the connection.
    """

    def __init__(self, app, api_key: str | None, max_body: int, model_name: str | None = None, routes=(),
                 body_timeout: float = BODY_TIMEOUT_S):
        """`routes`: the app's routes (a live list), to tell which take a body."""
        self.app, self.api_key, self.max_body, self.model_name = app, api_key, max_body, model_name
        self.routes, self.body_timeout = routes, body_timeout
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorized = self._expected is None or self._key_matches(headers)
        scope.setdefault("state", {})["authorized"] = authorized
        if not authorized and access(scope["path"]) == KEYED:
            return await _closing(error_response(
                401, "missing or wrong API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                "authentication_error"), sends_body(headers))(scope, receive, send)
        full = authorized and takes_body(self.routes, scope)
        budget = self.max_body if full else BODYLESS_BYTES
        try:
            body = await read_body(receive, budget, self.body_timeout, full, declared_length(headers))
        except ClientLeft:
            return
        except BodyRefused as refused:
            return await _closing(error_response(refused.status, refused.message))(scope, receive, send)
        # the request's trace parent and API operation, for its span (read where the engine queues it)
        current_origin.set(TraceOrigin({name: headers[name.encode()].decode("latin-1") for name in TRACE_HEADERS
                                        if name.encode() in headers}, operation_of(scope["path"]), self.model_name))
        await self.app(scope, replaying(body, receive), send)

    def _key_matches(self, headers: dict) -> bool:
        """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`; compared in constant time."""
        bearer = secrets.compare_digest(headers.get(b"authorization", b""), self._expected)
        x_api_key = secrets.compare_digest(headers.get(b"x-api-key", b""), self._expected[len(b"Bearer "):])
        return bearer or x_api_key


def _closing(response, close: bool = True):
    """The response, closing its connection after it when `close`: a body left unread is never read."""
    if close:
        response.headers["connection"] = "close"
    return response

