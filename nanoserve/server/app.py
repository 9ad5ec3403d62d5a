"""The OpenAI-compatible HTTP API over an EngineHost: completions, chat, models, /health, /metrics.

A client's bad input is always a 4xx with an OpenAI-shaped error body and never costs the server anything:
requests are validated before they reach the engine, and a refused or disconnected request holds no blocks.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware

from nanoserve.errors import NanoserveError
from nanoserve.outputs import RequestOutput
from nanoserve.server.host import EngineHost, HostStopped
from nanoserve.server.metrics import Metrics
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from nanoserve.server.responses import chat_chunk, chat_response, completion_chunk, completion_response

MAX_BODY_BYTES = 4 * 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


class _Guard(BaseHTTPMiddleware):
    """API key and body size, checked before a route parses anything."""

    def __init__(self, app, api_key: str | None, max_body: int):
        super().__init__(app)
        self.api_key, self.max_body = api_key, max_body

    async def dispatch(self, request: Request, call_next):
        if self.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                              "authentication_error")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return _error(413, f"request body is {int(length)} bytes; the limit is {self.max_body}")
        return await call_next(request)


def build_app(host: EngineHost, model_name: str, api_key: str | None = None, max_waiting: int = 256,
              max_body: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="nanoserve", version="0.1.0")
    app.add_middleware(_Guard, api_key=api_key, max_body=max_body)
    metrics = Metrics(host.stats, model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        return _error(400, f"{where + ': ' if where else ''}{message}", param=where or None)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(NanoserveError)
    async def _refused(_, exc: NanoserveError):
        return _error(400, str(exc), param=getattr(exc, "field", None))

    @app.exception_handler(HostStopped)
    async def _stopped(_, exc: HostStopped):
        return _error(503, str(exc), "server_error")

    def check(body) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           "not_found_error", "model")
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported yet; send n separate requests", param="n")
        if host.stats().scheduler.waiting >= max_waiting:
            raise APIError(503, f"the waiting queue is full ({max_waiting} requests); retry shortly",
                           "server_error")

    def room_for(ids: list[int]) -> int:
        return max(1, host.engine.max_model_len - len(ids))

    async def respond(ids, params, rid, stream_it: bool, events, response, body, tokenizer, logprobs):
        """Submit (a refusal raises here, as a 400) and answer with an SSE stream or one JSON body."""
        stream = await host.open(ids, params, request_id=rid)
        if stream_it:
            return _sse(events(stream, rid, model_name, body, tokenizer, metrics))
        final = await _last(stream)
        metrics.observe(final)
        return response(final, rid, model_name, tokenizer, logprobs)

    @app.get("/health")
    async def health():
        return {"status": "ok" if host.running else "stopped", **host.stats().as_dict()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nanoserve", "max_model_len": host.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported yet; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty; send at least one token", param="prompt")
        tokenizer = host.engine.tokenizer  # read per request: a restart may bring a new engine
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = body.sampling_params(body.logprobs, None if body.max_tokens else room_for(ids))
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await respond(ids, params, rid, body.stream, _completion_events, completion_response,
                             body, tokenizer, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check(body)
        messages = [m.as_template_message() for m in body.messages]
        tokenizer = host.engine.tokenizer
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                            tokenize=True)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        params = body.sampling_params(body.chat_logprobs(), None if body.max_tokens else room_for(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await respond(ids, params, rid, body.stream, _chat_events, chat_response,
                             body, tokenizer, body.chat_logprobs())

    return app


async def _last(stream) -> RequestOutput:
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        await stream.aclose()  # a client gone before the end aborts its request
    return last


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_events(stream, rid, model, body, tokenizer, metrics):
    created = int(time.time())
    try:
        async for out in stream:
            if out.delta_text or out.finished:
                yield completion_chunk(out, rid, model, created, tokenizer, body.logprobs)
    finally:
        await stream.aclose()
    metrics.observe(out)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": out.usage}


async def _chat_events(stream, rid, model, body, tokenizer, metrics):
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]}
    try:
        async for out in stream:
            if out.delta_text or out.finished or (body.chat_logprobs() is not None and out.delta_token_ids):
                yield chat_chunk(out, base, tokenizer, body.chat_logprobs())
    finally:
        await stream.aclose()
    metrics.observe(out)
    if body.stream_options and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": out.usage}
