"""Lone UTF-16 surrogates in a JSON body, refused with a 400 that names the field, before any route reads it.

JSON may spell a surrogate half on its own (`"\\ud800"`); json.loads turns it into a Python string that no
UTF-8 encoder takes, so the tokenizer, a stop string or a grammar failed on it deep inside (a 500). Free text
enters at many fields on every API (prompts, messages and their parts, stop strings, grammars, tools), so the
body is checked once, here, as a pure ASGI middleware inside the guard (which has read the body whole).
"""

from __future__ import annotations

import json
import re

from nanoserve.server.body import replaying
from nanoserve.server.context import error_response

# a \uD800-\uDFFF escape: without one, no string in the body can hold a surrogate (raw UTF-8 cannot encode it)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: bytes) -> tuple[str, str] | None:
    """(where, the surrogate as an escape) for the first string in a JSON body holding a lone surrogate, or None
    (a body that is not JSON is left to the route's own parser to refuse)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack = [("", document)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                found = _SURROGATE.search(key)
                if found:
                    return f"{where + ': ' if where else ''}the key {key[:40]!r}", found.group()
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                return where or "the body", found.group()
    return None


def surrogate_message(where: str, surrogate: str) -> str:
    return (f"{where} contains a lone UTF-16 surrogate (\\u{ord(surrogate):04x}); send valid Unicode (a "
            "surrogate escape must be a high one followed by a low one, as in \\ud83d\\ude00)")


class LoneSurrogates:
    """Refuse a JSON body with a lone surrogate in any string (a 400 naming the field); pass the rest on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        found = lone_surrogate(body)
        if found is not None:
            return await error_response(400, surrogate_message(*found), param=found[0])(scope, receive, send)
        await self.app(scope, replaying(body, receive), send)

