"""The OpenAI-compatible HTTP API over an EngineHost: completions, chat, models, tokenize, /health, /metrics.

The rule every route keeps: a request field is honoured, or refused with a 400 that says it is not supported and
what to do instead; it is never accepted and ignored. Fields outside OpenAI's and vLLM's request schemas are
ignored with one warning in the log, as vLLM does (protocol.py lists which is which). Every error, a 404 or 405
included, is an OpenAI-shaped body, and a refused or disconnected request holds no blocks: requests are
validated before they reach the engine, and a stream that ends early aborts its requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import secrets
import uuid
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.errors import NanoserveError
from nanoserve.server.access import KEYED, WITHHELD, access
from nanoserve.server.chat import ChatResponder
from nanoserve.server.completions import CompletionResponder, engine_max_tokens, prompt_logprobs_wanted
from nanoserve.server.disconnect import ClientGone, unless_disconnected
from nanoserve.server.fanout import Fanout
from nanoserve.server.host import EngineFailure, EngineHost, HostStopped
from nanoserve.server.metrics import Metrics
from nanoserve.server.openapi import ERRORS, install_openapi, ok, streamed
from nanoserve.server.prompts import chat_prompt, completion_prompts, rendered_chat
from nanoserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from nanoserve.server.refusals import CountRefusals
from nanoserve.server.schemas import (
    ChatResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
    Version,
)
from nanoserve.tools.parsers import parser_for

MAX_BODY_BYTES = 4 * 2**20
DISCARD_BYTES = 64 * 2**20  # past the limit, bytes read and dropped so the 413 reaches the client
PREPARE_THREADS = 4  # tokenization and chat templating run here, off the event loop that feeds every stream
log = logging.getLogger("nanoserve.server")
_warned: set[str] = set()  # unknown field names already named in the log


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


class _Guard:
    """API key and body size, checked before a route parses anything (a pure ASGI middleware).

    The key is asked of every route but those access.WITHOUT_KEY lists; whether the caller sent it is left in
    the request's state (`authorized`) for the routes that answer both, less without it (/health).

    The body is counted as it arrives, not trusted from Content-Length: a chunked upload has none, and was read,
    parsed and tokenized whole before. It is read here up to the limit and handed on; one byte over, the
    request is answered 413 and the rest is never read.
    """

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorized = self._expected is None or \
            secrets.compare_digest(headers.get(b"authorization", b""), self._expected)  # constant time
        scope.setdefault("state", {})["authorized"] = authorized
        if not authorized and access(scope["path"]) == KEYED:
            return await _error(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
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
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, which the routes watch for

        await self.app(scope, replay, send)

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
        response = _error(413, f"request body is {said}; the limit is {self.max_body} bytes; send a shorter "
                               "prompt, or split the batch across requests")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


_prepare = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="nanoserve-prepare")


async def compiled(engine, params) -> None:
    """Compile a request's structured-output grammar off the event loop and off the engine's step (a bad one is
    a 400 here); the engine thread then finds it in the compiled cache."""
    if params.structured_outputs is not None:
        await off_loop(engine.grammars.compile, params.structured_outputs)


async def off_loop(fn, *args, **kwargs):
    """Run CPU-bound request preparation (tokenizing a long prompt, rendering a chat template) on a worker
    thread: on the event loop, one 4 MB prompt stalled every other stream for seconds."""
    return await asyncio.get_running_loop().run_in_executor(_prepare, functools.partial(fn, *args, **kwargs))


def _version() -> str:
    try:
        return metadata.version("nanoserve")
    except metadata.PackageNotFoundError:
        from nanoserve import __version__

        return __version__


def build_app(host: EngineHost, model_name: str, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
              trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
              prompt_tokens_details: bool = True) -> FastAPI:
    """`trust_request_chat_template`: a chat request may bring its own template (vLLM's flag of that name);
    a template is code the server renders, so without it such a request is refused. `tool_call_parser` names
    the format tool_choice 'auto' reads calls in, when the chat template's own is not the one to use.
    `prompt_tokens_details` off leaves usage.prompt_tokens_details (cached tokens) out, as vLLM does without
    --enable-prompt-tokens-details. The waiting queue's limit is the host's (EngineHost(max_waiting=...)): it
    is checked on the engine thread, where it cannot race."""
    app = FastAPI(title="nanoserve", version=_version())
    app.add_middleware(_Guard, api_key=api_key, max_body=max_body)
    app.add_middleware(CountRefusals, refusals=host.refusals)  # added last: outermost, it sees the guard's answers
    metrics = Metrics(host.stats, model_name)
    install_openapi(app, lambda: host.serving().max_model_len)
    _install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves {model_name!r}",
                           "not_found_error", "model")

    def admit(body) -> None:
        """The checks every generation request passes before it reaches the engine."""
        check_model(body.model)
        refused = body.refusal()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        unknown = [f for f in body.unknown_fields() if f not in _warned]
        if unknown:
            _warned.update(unknown)
            log.warning("ignoring request fields that are neither OpenAI's nor vLLM's: %s", ", ".join(unknown))

    def request_id(body, prefix: str) -> str:
        return f"{prefix}-{body.request_id or uuid.uuid4().hex}"

    def room_for(engine, ids: list[int]) -> int:
        return max(1, engine.max_model_len - len(ids))

    def check_template_trusted(template: str | None) -> None:
        if template is not None and not trust_request_chat_template:
            raise APIError(400, "chat_template from a request is rendered on the server, so this server refuses "
                                "it; start it with --trust-request-chat-template to allow it", param="chat_template")

    @app.get("/health", summary="The engine's stats snapshot (flags, scheduler, KV pool, paged read, rows); "
                                "503 with the reason while it is stopped, failing repeatedly, or failed to load. "
                                "On a server with an API key, a caller without it gets the status and reason only",
             responses={503: {"description": "The snapshot, with status stopped, unhealthy or failed and the "
                                             "reason"}})
    async def health(request: Request):
        state = host.health()
        body = {"status": state.status, "reason": state.reason}
        if request.state.authorized:
            body |= {"failed_steps_total": host.failures.total, **host.stats().as_dict()}
        else:
            body["snapshot"] = WITHHELD
        return JSONResponse(body, status_code=200 if state.ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text/plain)",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache", responses={401: ERRORS[401], 503: ERRORS[503]}, summary="Forget every cached KV block's name (vLLM's route); requests "
                                             "running keep their blocks. Guarded by the API key.")
    async def reset_prefix_cache():
        forgotten = await host.call(lambda engine: engine.reset_prefix_cache())
        return {"reset": True, "blocks_forgotten": forgotten}

    @app.get("/version", responses=ok(Version))
    async def version():
        return {"version": _version()}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "nanoserve", "root": model_name,
                "parent": None, "max_model_len": host.serving().max_model_len}

    @app.get("/v1/models", responses=ok(ModelList))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={**ERRORS, **ok(ModelCard)})
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize", responses={**ERRORS, **ok(TokenizeResponse)})
    async def tokenize(body: TokenizeRequest):
        engine = host.serving()
        tokenizer = engine.tokenizer
        check_model(body.model)
        if body.messages is not None:
            check_template_trusted(body.chat_template)
            chat = body.as_chat()
            ids = await off_loop(chat_prompt, chat, tokenizer, chat.tool_request())
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await off_loop(tokenizer.encode, body.prompt, add_special_tokens=special)
        strs = [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses={**ERRORS, **ok(DetokenizeResponse)})
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        engine = host.serving()
        tokenizer, vocab = engine.tokenizer, engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info", responses=ok(TokenizerInfo))
    async def tokenizer_info():
        """vLLM's route: what a client needs to tokenize as this server does (lm-eval's remote tokenizer)."""
        engine = host.serving()
        tokenizer = engine.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token, "pad_token": None, "model_max_length": engine.max_model_len,
                "chat_template": tokenizer.chat_template}

    @app.post("/v1/completions", responses={**ERRORS, **streamed(CompletionResponse)})
    async def completions(body: CompletionRequest, request: Request):
        admit(body)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 generates nothing; it is only meaningful with echo (to score the "
                                "prompt); send max_tokens >= 1", param="max_tokens")
        engine = host.serving()  # read per request: a restart may bring a new engine
        tokenizer = engine.tokenizer
        prompts = await off_loop(completion_prompts, body, tokenizer, engine.model_config.vocab_size,
                                 engine.max_model_len)
        ids = [p[1] for p in prompts]
        longest = max(ids, key=len)
        params = body.sampling_params(engine_max_tokens(body, room_for(engine, longest)), body.logprobs,
                                      prompt_logprobs_wanted(body))
        rid = request_id(body, "cmpl")
        await compiled(engine, params)
        fanout = await Fanout(host, ids, params, rid, prompt_tokens_details).open(body.user, body.cache_salt,
                                                                                  body.session_id)
        responder = CompletionResponder(body, fanout, [p[0] for p in prompts], tokenizer, model_name, rid, metrics)
        return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())

    @app.post("/v1/chat/completions", responses={**ERRORS, **streamed(ChatResponse)})
    async def chat(body: ChatCompletionRequest, request: Request):
        admit(body)
        check_template_trusted(body.chat_template)
        engine = host.serving()
        tokenizer = engine.tokenizer
        tools = body.tool_request()
        parser = parser_for(tools, tokenizer.template_source(body.chat_template, tools=[]) if tools else "",
                            bool(tools) and tokenizer.template_reads("tools", body.chat_template), tool_call_parser)
        text, ids = await off_loop(rendered_chat, body, tokenizer, tools, engine.max_model_len)
        limit = body.token_limit()
        params = body.sampling_params(limit if limit is not None else room_for(engine, ids), body.chat_logprobs())
        rid = request_id(body, "chatcmpl")
        await compiled(engine, params)
        fanout = await Fanout(host, [ids], params, rid, prompt_tokens_details).open(body.user, body.cache_salt,
                                                                                    body.session_id)
        responder = ChatResponder(body, fanout, tokenizer, model_name, rid, metrics, parser, text)
        return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())

    return app


# pydantic's type errors -> what the field takes, in JSON's words
_TAKES = {"bool_type": "true or false (a JSON boolean)", "bool_parsing": "true or false (a JSON boolean)",
          "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
          "list_type": "a list", "dict_type": "an object"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        elif first.get("type") in _TAKES:
            came = first.get("input")
            shown = json.dumps(came)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            message = f"must be {_TAKES[first['type']]}, not {'the string ' if isinstance(came, str) else ''}{shown}"
        return _error(400, f"{where + ': ' if where else ''}{message}", param=where or None)

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
        return JSONResponse(error_body(message, kinds.get(exc.status_code, "invalid_request_error"), None,
                                       exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        log.exception("request failed")
        return _error(500, f"the server failed on this request: {exc}", "server_error")
