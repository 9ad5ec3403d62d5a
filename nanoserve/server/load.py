"""How loaded the server is, as routers ask: the generation requests in flight (vLLM's GET /load, counted from a
request's arrival until its answer's last byte, streams included) and, on a completion or chat answer whose
request sent `endpoint-load-metrics-format: TEXT` or `JSON`, the ORCA load report header `endpoint-load-metrics`
(KV-cache use and waiting requests) that load balancers read, in vLLM's format."""

from __future__ import annotations

import json
from collections.abc import Callable

LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
                        "/v1/messages", "/invocations"})
ORCA_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # vLLM's: its two OpenAI generation routes
FORMAT_HEADER, REPORT_HEADER = b"endpoint-load-metrics-format", b"endpoint-load-metrics"


class LoadTracker:
    """The count /load answers; changed only on the event loop."""

    def __init__(self):
        self.in_flight = 0


def orca_report(form: str, named: dict[str, float]) -> str:
    """vLLM's header value: `TEXT named_metrics.a=1.0, named_metrics.b=2.0` or `JSON {"named_metrics": {...}}`."""
    if form == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())
    return "JSON " + json.dumps({"named_metrics": named})


class ServerLoad:
    """ASGI middleware inside the API-key guard: a refused request is neither counted nor told the load.
    `named` gives the report's figures when a response asks for them."""

    def __init__(self, app, tracker: LoadTracker, named: Callable[[], dict[str, float]]):
        self.app, self.tracker, self.named = app, tracker, named

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LOAD_PATHS:
            return await self.app(scope, receive, send)
        form = dict(scope["headers"]).get(FORMAT_HEADER, b"").decode("latin-1").strip().lower()
        reporting = form in ("text", "json") and scope["path"] in ORCA_PATHS

        async def send_reporting(message):
            if message["type"] == "http.response.start" and message["status"] == 200 and _is_json(message):
                header = orca_report(form, self.named()).encode("latin-1")
                message = {**message, "headers": [*message.get("headers", []), (REPORT_HEADER, header)]}
            await send(message)

        self.tracker.in_flight += 1
        try:
            await self.app(scope, receive, send_reporting if reporting else send)
        finally:
            self.tracker.in_flight -= 1


def _is_json(message) -> bool:
    """A whole answer (a stream's headers go out before any load could be said of its end, as vLLM's do)."""
    return any(k == b"content-type" and v.startswith(b"application/json") for k, v in message.get("headers", []))
