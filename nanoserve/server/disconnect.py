"""A non-streamed response is computed while the client may leave: watch for it, and abort the work if it does.

A streamed response notices a departed client when its next chunk cannot be sent, and closing the stream aborts
its requests. A non-streamed handler sends nothing until the end, and the ASGI server does not cancel it when
the client goes, so without this its requests ran to their last token holding blocks (a client that timed out
after 2 s left the engine generating for minutes). After the body is read, the next ASGI message a request
receives is `http.disconnect`, sent when the client closes the connection: that is the signal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from starlette.requests import Request


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client closed the connection before its non-streamed response was ready; nothing is sent."""


async def unless_disconnected(request: Request, work: Awaitable):
    """The result of `work`, or, if the client disconnects first, `work` cancelled (its fanout closes, which
    aborts its engine requests and returns their blocks) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watch.done():  # we were cancelled ourselves: take the work with us
            task.cancel()
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task  # let its cleanup (the aborts) run before the handler returns
    except asyncio.CancelledError:
        pass
    raise ClientGone("the client disconnected before the response was ready")
