"""The API key and the body size limit, checked before any route parses a request (a pure ASGI middleware)."""

from __future__ import annotations

import secrets

from nanoserve.server.access import KEYED, access
from nanoserve.server.context import error_response
from nanoserve.tracing import TRACE_HEADERS, TraceOrigin, current_origin, operation_of

MAX_BODY_BYTES = 4 * 2**20
DISCARD_BYTES = 64 * 2**20  # past the limit, bytes read and dropped so the 413 reaches the client


class Guard:
    """API key and body size, checked before a route parses anything (a pure ASGI middleware).

    The key is asked of every route but those access.WITHOUT_KEY lists; whether the caller sent it is left in
    the request's state (`authorized`) for the routes that answer both, less without it (/health).

    The body is counted as it arrives, not trusted from Content-Length: a chunked upload has none, and was read,
    parsed and tokenized whole before. It is read here up to the limit and handed on; one byte over, the
    request is answered 413 and the rest is never read.
    """

    def __init__(self, app, api_key: str | None, max_body: int, model_name: str | None = None):
        self.app, self.api_key, self.max_body, self.model_name = app, api_key, max_body, model_name
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorized = self._expected is None or self._key_matches(headers)
        scope.setdefault("state", {})["authorized"] = authorized
        if not authorized and access(scope["path"]) == KEYED:
            return await error_response(401, "missing or wrong API key; send 'Authorization: Bearer <key>' (or "
                                             "'x-api-key: <key>')",
                                        "authentication_error")(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return await self._too_large(int(length), scope, receive, send, more=True)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: nobody to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await self._too_large(None, scope, receive, send, more=message.get("more_body", False))
            if not message.get("more_body", False):
                break
        # the request's trace parent and API operation, for its span (read where the engine queues it)
        current_origin.set(TraceOrigin({name: headers[name.encode()].decode("latin-1") for name in TRACE_HEADERS
                                        if name.encode() in headers}, operation_of(scope["path"]), self.model_name))
        await self.app(scope, _replaying(b"".join(chunks), receive), send)

    def _key_matches(self, headers: dict) -> bool:
        """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`; compared in constant time."""
        bearer = secrets.compare_digest(headers.get(b"authorization", b""), self._expected)
        x_api_key = secrets.compare_digest(headers.get(b"x-api-key", b""), self._expected[len(b"Bearer "):])
        return bearer or x_api_key

    async def _too_large(self, declared: int | None, scope, receive, send, more: bool):
        """Answer 413. The rest of the body is read and dropped first (never parsed), up to DISCARD_BYTES:
        a client that is still uploading reads a response only once its upload is done, so closing on it
        would show it a connection reset instead of the reason."""
        discarded = 0
        while more and discarded <= DISCARD_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # gone
            discarded += len(message.get("body", b""))
            more = message.get("more_body", False)
        said = f"{declared} bytes" if declared is not None else f"more than {self.max_body} bytes (counted as sent)"
        response = error_response(413, f"request body is {said}; the limit is {self.max_body} bytes; send a "
                                       "shorter prompt, or split the batch across requests")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _replaying(body: bytes, receive):
    """A `receive` that hands the app the body already read, whole, then passes on to the client's."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: http.disconnect, which the routes watch for

    return replay
