"""Reading a request's body before any route sees it: within a byte budget, and whole within a deadline.

uvicorn reads a body with no deadline and leaves the budget to the app, so a client that promises a large body
and sends it slowly (or never) holds its connection, and whatever it sent, for as long as it likes. Here the
budget is known before a byte is read (a route that takes no body allows BODYLESS_BYTES), a declared length
over it is refused at once, and the whole body must arrive within the deadline (nginx's client_body_timeout,
counted over the whole body rather than between reads, so trickling a byte at a time does not extend it).
"""

from __future__ import annotations

import asyncio
import time

from starlette.routing import Match

BODYLESS_BYTES = 4096  # what a route that takes no body accepts: an empty JSON object, a stray newline
DISCARD_BYTES = 64 * 2**20  # past the limit, bytes read and dropped so the 413 reaches the client


class BodyRefused(Exception):
    """The body was not read: `status` (413 or 408) and the reason; the connection is closed after the answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ClientLeft(Exception):
    """The client closed the connection mid-body: there is nobody to answer."""


def takes_body(routes, scope) -> bool:
    """Whether the route `scope` reaches takes a body: one with a pydantic body, or whose OpenAPI description
    declares one (a route that reads its body itself says so with `openapi_extra={"requestBody": ...}`). An
    unknown path, or a method the path does not answer, takes none."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "body_field", None) is not None or "requestBody" in (
                getattr(route, "openapi_extra", None) or {})
    return False


def declared_length(headers: dict) -> int | None:
    """The Content-Length header's value, when it is a number (a chunked body has none)."""
    length = headers.get(b"content-length", b"")
    return int(length) if length.isdigit() else None


def sends_body(headers: dict) -> bool:
    """Whether the request says a body follows (a length above zero, or chunked)."""
    return (declared_length(headers) or 0) > 0 or b"transfer-encoding" in headers


async def read_body(receive, budget: int, timeout: float, discard: bool, declared: int | None = None) -> bytes:
    """The whole body, or BodyRefused: 413 when its `declared` length, or one byte counted, is past `budget`;
    408 when it is not whole `timeout` seconds after reading began. Past the budget the rest is read and dropped first (never kept) when `discard`, up to
    DISCARD_BYTES and within the same deadline: a client still uploading reads the answer only once its upload
    is done, and closing on it would show it a connection reset instead of the reason."""
    deadline = time.monotonic() + timeout
    if declared is not None and declared > budget:
        if discard:
            await _drop_rest(receive, True, deadline, timeout)
        raise BodyRefused(413, too_large(declared, budget))
    chunks, size = [], 0
    while True:
        message = await _next(receive, deadline, timeout)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > budget:
            if discard:
                await _drop_rest(receive, more, deadline, timeout)
            raise BodyRefused(413, too_large(None, budget))
        if not more:
            return b"".join(chunks)


def too_large(declared: int | None, budget: int) -> str:
    said = f"{declared} bytes" if declared is not None else f"more than {budget} bytes (counted as sent)"
    if budget == BODYLESS_BYTES:
        return f"request body is {said}, but this route takes no body (up to {budget} bytes); send none"
    return (f"request body is {said}; the limit is {budget} bytes; send a shorter prompt, or split the batch "
            "across requests")


async def _next(receive, deadline: float, timeout: float) -> dict:
    try:
        message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise BodyRefused(408, f"the request body did not arrive within {timeout:g} s; send the whole body "
                               "promptly (the server's --body-timeout)") from None
    if message["type"] != "http.request":
        raise ClientLeft
    return message


async def _drop_rest(receive, more: bool, deadline: float, timeout: float) -> None:
    discarded = 0
    while more and discarded <= DISCARD_BYTES:
        try:
            message = await _next(receive, deadline, timeout)
        except BodyRefused:
            return  # too slow even to drop: the 413 goes out now, and the connection closes
        discarded += len(message.get("body", b""))
        more = message.get("more_body", False)


def replaying(body: bytes, receive):
    """A `receive` that hands the app the body already read, whole, then passes on to the client's."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: http.disconnect, which the routes watch for

    return replay
