"""The budget a chat template renders within. Jinja's sandbox keeps a template away from Python's internals, but
not from spending: `{{ 'a' * 20000000 }}` took 103 s and 600 MB, and a loop of loops holds a worker thread for
hours. A template is code (a request's own, with --trust-request-chat-template, or the server's over a hostile
conversation), so its rendering is bounded: its time, the size of every string, list and number it builds and
of its output, the items its loops take, and range(). Past a bound the render stops with a TemplateBudgetError
that names it (a 400).

This module holds the limits and the meter that counts one render's spending; template_sizes.py checks what a
value or an operation would build, and template_sandbox.py wires both into the Jinja environment tokenizer.py
renders with. The server renders a request's templates inside `for_request`: its renders share one deadline,
and they stop at their next check once the request's client has gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2

from nanoserve.errors import RequestError

__all__ = ["LIMITS", "Limits", "RenderAbandoned", "TemplateBudgetError", "count_built", "count_item", "for_request",
           "render", "tick"]


@dataclass(frozen=True)
class Limits:
    """What one request's rendering may spend."""

    seconds: float = 10.0  # all of a request's renders together
    # any string or output: twice the 4 MiB body limit, as a conversation renders to about its own size plus
    # each message's markup
    chars: int = 8 * 2**20
    built_chars: int = 64 * 2**20  # all the strings a render builds, together: what it could be holding
    items: int = 1_000_000  # a list the template builds
    range_items: int = 100_000  # range(): Jinja's own MAX_RANGE
    loop_items: int = 4_000_000  # items all of a render's loops take, together
    int_bits: int = 4096  # a number built by * or **


LIMITS = Limits()


class TemplateBudgetError(RequestError):
    """A render went past one of its limits."""


class RenderAbandoned(Exception):
    """The client of the render left, so the render stopped: nobody reads the answer."""


@dataclass
class _Request:
    """What the renders of one request share: their deadline, and the event that says its client has gone."""

    deadline: float
    stop: threading.Event | None = None


class _Meter:
    """One render's spending: the request's deadline and stop event, and the render's loop items."""

    def __init__(self, limits: Limits, request: _Request):
        self.limits, self.request = limits, request
        self.items = self.built = self.ticks = 0

    def tick(self) -> None:
        """Every operation of the render ticks; each 16th looks at the clock and the client (a look costs more
        than most operations)."""
        self.ticks += 1
        if not self.ticks & 15:
            self.check()

    def check(self) -> None:
        """Stop the render if its client has gone or its time is up."""
        stop = self.request.stop
        if stop is not None and stop.is_set():
            raise RenderAbandoned("the client left, so the chat template stopped rendering")
        if time.monotonic() > self.request.deadline:
            raise TemplateBudgetError(f"the chat template took longer than {self.limits.seconds:g} s to render this "
                                      "conversation; send a shorter conversation or a simpler template")

    def item(self) -> None:
        """One more loop item: counted against the render's total, and the clock looked at now and then."""
        self.items += 1
        if self.items > self.limits.loop_items:
            raise TemplateBudgetError(f"the chat template's loops took more than {self.limits.loop_items:,} items in "
                                      "all; send a shorter conversation or a template with fewer loops")
        if self.items % 64 == 0:
            self.check()

    def build(self, chars: int) -> None:
        """A string of `chars` characters built: counted against the render's total (and a tick)."""
        self.tick()
        self.built += chars
        if self.built > self.limits.built_chars:
            raise TemplateBudgetError(f"the chat template built more than {self.limits.built_chars:,} characters "
                                      "of text in all; send a shorter conversation or a template that builds less")


_meter: ContextVar[_Meter | None] = ContextVar("nanoserve_template_meter", default=None)
_request: ContextVar[_Request | None] = ContextVar("nanoserve_template_request", default=None)


@contextlib.contextmanager
def for_request(stop: threading.Event | None = None) -> Iterator[None]:
    """Renders in this block (on this thread) are one request's: they share one LIMITS.seconds, so a request
    that renders several times (the checks in server/prompts.py) is bounded as a whole, and they stop at their
    next check once `stop` is set (the client has gone)."""
    token = _request.set(_Request(time.monotonic() + LIMITS.seconds, stop))
    try:
        yield
    finally:
        _request.reset(token)


def render(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """The template's text, rendered within LIMITS: streamed, so the output is counted as it grows."""
    request = _request.get() or _Request(time.monotonic() + LIMITS.seconds)
    meter = _Meter(LIMITS, request)
    token = _meter.set(meter)
    try:
        meter.check()  # a request whose client has gone, or whose time is spent, renders nothing more
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > meter.limits.chars:
                raise too_long("the rendered prompt")
            out.append(chunk)
            meter.check()
        return "".join(out)
    finally:
        _meter.reset(token)


def tick() -> None:
    """The running render's check of its clock and its client (nothing outside a render)."""
    meter = _meter.get()
    if meter is not None:
        meter.tick()


def count_item() -> None:
    """One loop item of the running render (nothing outside a render)."""
    meter = _meter.get()
    if meter is not None:
        meter.item()


def count_built(chars: int) -> None:
    """A string the running render built (nothing outside a render)."""
    meter = _meter.get()
    if meter is not None:
        meter.build(chars)


def too_long(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(f"{what} would be over the chat template's limit of {LIMITS.chars:,} characters; "
                               "send a shorter conversation or a template that builds less")


def too_many(n: int) -> TemplateBudgetError:
    return TemplateBudgetError(f"a list the template builds would have {n:,} items, over the chat template's "
                               f"limit of {LIMITS.items:,}")


def too_big() -> TemplateBudgetError:
    return TemplateBudgetError(f"a number the template builds would be over {LIMITS.int_bits:,} bits, the chat "
                               "template's limit")
