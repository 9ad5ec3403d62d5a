"""The budget a chat template renders within. Jinja's sandbox keeps a template away from Python's internals, but
not from spending: `{{ 'a' * 20000000 }}` took 103 s and 600 MB, and a loop of loops holds a worker thread for
hours. A template is code (a request's own, with --trust-request-chat-template, or the server's over a hostile
conversation), so one render is bounded here: its time, the size of every string, list and number it builds and
of its output, the items its loops take, and range(). Past a bound the render stops with a TemplateBudgetError
that names it (a 400); a render whose client has gone stops at its next check (`stopped_by`).

tokenizer.py builds its environment from `BudgetedSandbox` and renders with `render`.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.runtime
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from nanoserve.errors import RequestError

__all__ = ["LIMITS", "BudgetedSandbox", "Limits", "RenderAbandoned", "TemplateBudgetError", "render", "stopped_by"]


@dataclass(frozen=True)
class Limits:
    """What one render may spend."""

    seconds: float = 10.0
    # any string or output: twice the 4 MiB body limit, as a conversation renders to about its own size plus
    # each message's markup
    chars: int = 8 * 2**20
    items: int = 1_000_000  # a list the template builds
    range_items: int = 100_000  # range(): Jinja's own MAX_RANGE
    loop_items: int = 4_000_000  # items all of a render's loops take, together
    int_bits: int = 4096  # a number built by * or **


LIMITS = Limits()


class TemplateBudgetError(RequestError):
    """A render went past one of its limits."""


class RenderAbandoned(Exception):
    """The client of the render left, so the render stopped: nobody reads the answer."""


class _Meter:
    """One render's spending: its deadline, its loop items, and the event that says its client has gone."""

    def __init__(self, limits: Limits, stop: threading.Event | None):
        self.limits, self.stop = limits, stop
        self.deadline = time.monotonic() + limits.seconds
        self.items = 0

    def tick(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise RenderAbandoned("the client left, so the chat template stopped rendering")
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template took longer than {self.limits.seconds:g} s to render this "
                                      "conversation; send a shorter conversation or a simpler template")

    def item(self) -> None:
        self.items += 1
        if self.items > self.limits.loop_items:
            raise TemplateBudgetError(f"the chat template's loops took more than {self.limits.loop_items:,} items in "
                                      "all; send a shorter conversation or a template with fewer loops")
        if self.items % 64 == 0:
            self.tick()


_meter: ContextVar[_Meter | None] = ContextVar("nanoserve_template_meter", default=None)
_stop: ContextVar[threading.Event | None] = ContextVar("nanoserve_template_stop", default=None)


@contextlib.contextmanager
def stopped_by(event: threading.Event) -> Iterator[None]:
    """Renders in this block (on this thread) stop at their next check once `event` is set."""
    token = _stop.set(event)
    try:
        yield
    finally:
        _stop.reset(token)


def render(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """The template's text, rendered within LIMITS: streamed, so the output is counted as it grows."""
    meter = _Meter(LIMITS, _stop.get())
    token = _meter.set(meter)
    try:
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > meter.limits.chars:
                raise _too_long("the rendered prompt")
            out.append(chunk)
            meter.tick()
        return "".join(out)
    finally:
        _meter.reset(token)


def _tick() -> None:
    meter = _meter.get()
    if meter is not None:
        meter.tick()


def _too_long(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(f"{what} would be over the chat template's limit of {LIMITS.chars:,} characters; "
                               "send a shorter conversation or a template that builds less")


def _chars(value: Any) -> int:
    """About how many characters `value` is as text, counted only until it passes the limit (so a list of a
    huge string many times is found out at its first items, before anything writes it out)."""
    limit, total, seen, stack = LIMITS.chars, 0, 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        seen += 1
        if seen % 4096 == 0:
            _tick()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            total += 2 + 2 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 1
        else:
            total += 8
    return total


def _as_text(value: Any, what: str = "a value the template writes out") -> Any:
    """`value`, refused if written out as text it would be past the limit."""
    if not isinstance(value, (int, float, bool)) and _chars(value) > LIMITS.chars:
        raise _too_long(what)
    return value


def _sized(value: Any) -> Any:
    """`value`, refused if it is a string, list or number past its limit (a cheap check: made on everything a
    call, filter or operator returns)."""
    if isinstance(value, str):
        if len(value) > LIMITS.chars:
            raise _too_long("a string the template builds")
    elif isinstance(value, (list, tuple, dict, set)):
        if len(value) > LIMITS.items:
            raise _too_many(len(value))
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > LIMITS.int_bits:
        raise _too_big()
    return value


def _too_many(n: int) -> TemplateBudgetError:
    return TemplateBudgetError(f"a list the template builds would have {n:,} items, over the chat template's "
                               f"limit of {LIMITS.items:,}")


def _too_big() -> TemplateBudgetError:
    return TemplateBudgetError(f"a number the template builds would be over {LIMITS.int_bits:,} bits, the chat "
                               "template's limit")


def _before_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*` and `**` whose results are too big to build (the size is known from the operands), and `%`
    formats too wide."""
    ints = isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool)
    if operator == "*" and ints:
        if left.bit_length() + right.bit_length() > LIMITS.int_bits:
            raise _too_big()
    elif operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, str) and isinstance(n, int) and len(seq) * n > LIMITS.chars:
            raise _too_long(f"a string * {n:,}")
        if isinstance(seq, (list, tuple)) and isinstance(n, int) and len(seq) * n > LIMITS.items:
            raise _too_many(len(seq) * n)
    elif operator == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > LIMITS.int_bits:
        raise _too_big()
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)


_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(fmt: str, args: Any) -> None:
    """`'%20000000s' % x` (and the format filter) build as wide a string as they are told: bound the widths."""
    for match in _PERCENT_WIDTH.finditer(fmt):
        for width in match.groups():
            if width and width != "*" and int(width) > LIMITS.chars:
                raise _too_long(f"a {width}-character field")
    _check_args(args if isinstance(args, tuple) else (args,), {})


def _check_args(args: tuple, kwargs: dict) -> None:
    """Arguments that set a size (a width, a count) within the limit, and none too big to write out."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > LIMITS.chars:
            raise TemplateBudgetError(f"{a:,} is over the chat template's limit of {LIMITS.chars:,} characters "
                                      "for a width or count")
        _as_text(a, "an argument")


def _check_str_call(method: Any, args: tuple, kwargs: dict) -> None:
    """String methods whose result can outgrow their inputs: bound it before it is built."""
    name = getattr(method, "__name__", "")
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in ("ljust", "rjust", "center", "zfill", "expandtabs"):
        _check_args(args, kwargs)
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else _sized(list(args[0]))
        _as_text(items)
        if len(owner) * len(items) > LIMITS.chars:
            raise _too_long("the joined string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _grown_by_replace(owner, args[0], args[1])
    elif name in ("translate", "maketrans"):
        raise TemplateBudgetError(f"str.{name} is not available to chat templates; use replace")


def _grown_by_replace(text: str, old: str, new: str) -> None:
    count = text.count(old) if old else len(text) + 1
    if len(text) + count * max(0, len(new) - len(old)) > LIMITS.chars:
        raise _too_long("the replaced string")


_WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate", "tojson")  # an argument sets a width
_TEXT_FILTERS = ("join", "string", "tojson", "pprint", "sum", "format", "urlize", "xmlattr")  # the value as text


def _sized_filter(name: str, fn):
    """A built-in filter with its arguments bounded before and its result after."""

    def bounded(*args, **kwargs):
        _tick()
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, nodes.EvalContext,
                                                         jinja2.Environment))]
        if name in _WIDTH_FILTERS:
            _check_args(tuple(values[1:]), kwargs)
        if name in _TEXT_FILTERS and values:
            _as_text(values[0])
        if name == "join" and len(values) > 1 and isinstance(values[1], str):
            if len(values[1]) * _count(values[0]) > LIMITS.chars:
                raise _too_long("the joined string")
        elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
            _grown_by_replace(*values[:3])
        elif name == "format" and values and isinstance(values[0], str):
            _check_percent_format(values[0], tuple(values[1:]))
        return _sized(fn(*args, **kwargs))

    bounded.__name__ = getattr(fn, "__name__", name)
    bounded.__dict__.update(getattr(fn, "__dict__", {}))  # pass_context and its kin
    return bounded


def _count(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        return 0


def _range(*args: int) -> range:
    """range() within the limit, as Jinja's sandbox bounds it, but refused as a request error that names it."""
    rng = range(*args)
    if len(rng) > LIMITS.range_items:
        raise TemplateBudgetError(f"range() of {len(rng):,} items is over the chat template's limit of "
                                  f"{LIMITS.range_items:,}")
    return rng


def _each(iterable: Any) -> Iterator[Any]:
    """A loop's items, each counted against the render's budget (a loop of loops is stopped, not run out)."""
    meter = _meter.get()
    for item in iterable:
        if meter is not None:
            meter.item()
        yield item


def _joined(parts: list) -> str:
    """`a ~ b`: the parts bounded before they are written out as text."""
    _as_text(parts, "a string the template builds with ~")
    return "".join(map(str, parts))


def _concat(pieces) -> str:
    """A block's text (a macro's, a {% set %} block's, a call's caller()): counted before it is joined."""
    pieces = list(pieces)
    if sum(len(p) for p in pieces) > LIMITS.chars:
        raise _too_long("a block's text")
    return "".join(pieces)


def _finalize(value: Any) -> Any:
    """Every {{ ... }} is bounded before it is written out as text."""
    return _as_text(value, "an expression's text")


class _Metered(NodeTransformer):
    """Every loop's items go through `_each`, and every `~` through `_joined`."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "nanoserve_each", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "nanoserve_joined", [], [], None, None,
                            lineno=node.lineno)


_LOADS = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every way a render spends time or memory metered (see the module)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any):
        super().__init__(finalize=_finalize, **options)
        self.globals["range"] = _range
        self.globals.pop("lipsum", None)  # writes as much text as it is asked for, and no template uses it
        self.filters = {name: _sized_filter(name, fn) for name, fn in self.filters.items()}
        self.filters["nanoserve_each"] = _each
        self.filters["nanoserve_joined"] = _joined
        self.concat = _concat

    def add_filter(self, name: str, fn) -> None:
        """A filter of the server's own, bounded as the built-in ones are."""
        self.filters[name] = _sized_filter(name, fn)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        loads = next(tree.find_all(_LOADS), None)
        if loads is not None:
            raise RequestError(f"the chat template uses {{% {type(loads).__name__.lower()} %}} (line "
                               f"{loads.lineno}): a chat template may not include, import or extend another, as "
                               "there is none to load; write it as one template")
        return _Metered().visit(tree)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _before_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's own names)
        _tick()
        _check_str_call(__obj, args, kwargs)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any):
        """str.format with its widths and arguments bounded, as % is."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            for match in re.finditer(r"\d+", "".join(spec for _, _, spec, _ in _fields(fmt) if spec)):
                if int(match.group()) > LIMITS.chars:
                    raise _too_long(f"a {match.group()}-character field")
            _check_args(args, kwargs)
            return _sized(wrapped(*args, **kwargs))

        return bounded


def _fields(fmt: str):
    import string

    try:
        return list(string.Formatter().parse(fmt))
    except ValueError:
        return []
