"""What every route module shares: the served model, its metrics, the checks a request passes before it reaches
the engine, and the worker threads request preparation runs on.

app.py builds one RouteContext and hands it to each routes_* module's `add_routes`; those import this module and
nothing of each other or of app.py, so a new route module (another API's shape) needs only this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import uuid
from dataclasses import dataclass, field
from importlib import metadata

from fastapi import Request
from fastapi.responses import JSONResponse

from nanoserve.errors import shown
from nanoserve.server.disconnect import ClientGone, unless_disconnected
from nanoserve.server.fanout import Fanout
from nanoserve.server.host import EngineHost
from nanoserve.server.load import LoadTracker
from nanoserve.server.metrics import Metrics
from nanoserve.server.protocol import StreamOptions, error_body
from nanoserve.template_budget import for_request

PREPARE_THREADS = 4  # tokenization and chat templating run here, off the event loop that feeds every stream
log = logging.getLogger("nanoserve.server")
_warned: dict[str, None] = {}  # unknown field names already named in the log (clipped), the latest WARNED_MAX
WARNED_MAX, NAME_KEPT = 100, 64  # a caller may send new names, and long ones, with every request


def _warn_unknown(names: list[str]) -> None:
    """Name unknown fields in the log once each, clipped; the latest WARNED_MAX names are remembered, the oldest
    forgotten first (a name forgotten is named again)."""
    unknown = list(dict.fromkeys(n if len(n) <= NAME_KEPT else n[:NAME_KEPT - 3] + "..." for n in names))
    unknown = [n for n in unknown if n not in _warned][:WARNED_MAX]
    if unknown:
        for name in unknown:
            _warned[name] = None
        while len(_warned) > WARNED_MAX:
            del _warned[next(iter(_warned))]
        log.warning("ignoring request fields that are neither OpenAI's nor vLLM's: %s", ", ".join(unknown))


class APIError(Exception):
    """A refusal a route raises; app.py's handler answers it with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error body: every refusal, the middleware's included, answers in this one shape."""
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


_prepare = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="nanoserve-prepare")


async def off_loop(fn, *args, **kwargs):
    """Run CPU-bound request preparation (tokenizing a long prompt, rendering a chat template) on a worker
    thread: on the event loop, one 4 MB prompt stalled every other stream for seconds."""
    return await asyncio.get_running_loop().run_in_executor(_prepare, functools.partial(fn, *args, **kwargs))


async def rendered_off_loop(request: Request | None, fn, *args, **kwargs):
    """off_loop for preparation that renders a chat template, given up when the client leaves (as
    unless_disconnected gives up a response): still queued for a thread, it never starts; running, the template
    stops at its next check. So callers who leave cannot keep the rendering threads from the next request (four
    abandoned conversations made a plain one wait 144 s). The request's renders share one time budget
    (template_budget.for_request)."""
    stop = threading.Event()
    work = off_loop(_rendering, stop, fn, *args, **kwargs)
    try:
        return await (work if request is None else unless_disconnected(request, work))
    finally:
        stop.set()  # done, or given up: a render still running stops at its next check


def _rendering(stop: threading.Event, fn, *args, **kwargs):
    """`fn` on a preparation thread, as one request's rendering (template_budget.for_request)."""
    if stop.is_set():  # the client left while this waited for a thread
        raise ClientGone("the client disconnected before its conversation was rendered")
    with for_request(stop):
        return fn(*args, **kwargs)


async def compiled(engine, params) -> None:
    """Compile a request's structured-output grammar off the event loop and off the engine's step (a bad one is
    a 400 here); the engine thread then finds it in the compiled cache."""
    if params.structured_outputs is not None:
        await off_loop(engine.grammars.compile, params.structured_outputs)


def validated(cls, data, *where):
    """`data` as request model `cls`, or the 400 a body of that model gets (RequestValidationError): for routes
    that read their body themselves and hand parts of it on. `where` says where a field came from: ("messages", 1)
    names the body's messages[1] for an error in `messages` (a batch's conversation 1)."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    def located(loc: tuple) -> tuple:
        return ("body", *where, *loc[1:]) if where and loc[:1] == where[:1] else ("body", *loc)

    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": located(err["loc"])} for err in e.errors()]) from None


def not_json_message(doc: str | bytes | None, pos: int, what: str | None) -> str:
    """What json.loads said and where, in its own words ("Expecting ',' delimiter at line 1, column 62 (char
    61)"): the line and column find the mistake in a body that was pretty-printed or built by hand."""
    where = ""
    if isinstance(doc, (str, bytes)) and isinstance(pos, int):
        text = doc.decode("utf-8", "replace") if isinstance(doc, bytes) else doc
        line, column = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
        where = f" at line {line}, column {column} (char {pos})"
    return f"request body is not valid JSON: {what or 'JSON decode error'}{where}"


def server_version() -> str:
    """The installed package's version (the source tree's when it is not installed): the app's and /version's."""
    try:
        return metadata.version("nanoserve")
    except metadata.PackageNotFoundError:
        from nanoserve import __version__

        return __version__


async def respond(responder, body, request: Request):
    """A generation's answer: server-sent events with stream: true, else one body, abandoned if the client
    leaves before it is done (the requests are then aborted, holding no blocks)."""
    return responder.stream() if body.stream else await unless_disconnected(request, responder.whole())


@dataclass(frozen=True)
class RouteContext:
    """What the routes are built over, fixed for the app's life (the engine is not: a route reads it per request
    from `host.serving()`, as a restart may bring a new one)."""

    host: EngineHost
    model_name: str
    metrics: Metrics
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    prompt_tokens_details: bool = False
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: usage on every chunk of a stream
    return_tokens_as_token_ids: bool = False  # vLLM's --return-tokens-as-token-ids: every request's default
    load: LoadTracker = field(default_factory=LoadTracker)  # generation requests in flight (GET /load)
    per_request_metrics: bool = False  # vLLM's --enable-per-request-metrics: timing on one-sequence answers

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {shown(name)} is not served here; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    def admit(self, body) -> None:
        """The checks every generation request passes before it reaches the engine (the server's defaults for
        its fields set first, so they are checked as the request's own)."""
        self._server_defaults(body)
        self.check_model(body.model)
        refused = body.refusal()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        _warn_unknown(body.unknown_fields())

    def _server_defaults(self, body) -> None:
        """What the server's flags ask of every OpenAI-shaped request (the turn APIs report usage and name tokens
        their own way)."""
        if self.return_tokens_as_token_ids and hasattr(body, "return_tokens_as_token_ids"):
            body.return_tokens_as_token_ids = True
        if self.force_include_usage and getattr(body, "stream", False) and hasattr(body, "stream_options"):
            # vLLM's flag: usage so far on every chunk, whatever the request's stream_options say
            body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    @staticmethod
    def request_id(body, prefix: str) -> str:
        return f"{prefix}-{body.request_id or uuid.uuid4().hex}"

    @staticmethod
    def room_for(engine, ids: list[int]) -> int:
        return max(1, engine.max_model_len - len(ids))

    def check_template_trusted(self, template: str | None) -> None:
        """A template is code the server renders, so a request's own is refused unless the operator allowed it."""
        if template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template from a request is rendered on the server, so this server refuses "
                                "it; start it with --trust-request-chat-template to allow it", param="chat_template")

    async def fanout(self, engine, prompts: list[list[int]], params, rid: str, body) -> Fanout:
        """The request's grammar compiled, then its prompts (n each) admitted to the engine as one Fanout."""
        await compiled(engine, params)
        return await Fanout(self.host, prompts, params, rid, self.prompt_tokens_details,
                            self.per_request_metrics).open(
            body.user, body.cache_salt, body.session_id, streamed=bool(getattr(body, "stream", False)))
