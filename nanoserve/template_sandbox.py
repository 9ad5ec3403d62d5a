"""The Jinja environment chat templates render in: Jinja's immutable sandbox (no reach into Python's internals)
with every way a template spends time or memory metered, so a render keeps within template_budget.LIMITS.

Every operator, call, attribute and item lookup ticks the render's clock (template_budget.tick) and has its
result sized (template_sizes.py); every loop item is counted; every {{ ... }}, `~` and block's text is bounded
before it is written out; range() is bounded; and a template that would load another ({% include %},
{% import %}, {% extends %}) is refused when it is parsed, as there is none to load.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.runtime
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from nanoserve import template_budget as budget
from nanoserve import template_sizes as sizes
from nanoserve.errors import RequestError
from nanoserve.template_budget import TemplateBudgetError

__all__ = ["BudgetedSandbox"]


_WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate", "tojson")  # an argument sets a width
_TEXT_FILTERS = ("join", "string", "tojson", "pprint", "sum", "format", "urlize", "xmlattr")  # the value as text


def _sized_filter(name: str, fn):
    """A built-in filter with its arguments bounded before and its result after."""

    def bounded(*args, **kwargs):
        budget.tick()
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, nodes.EvalContext,
                                                         jinja2.Environment))]
        if name in _WIDTH_FILTERS:
            sizes.check_args(tuple(values[1:]), kwargs)
        if name in _TEXT_FILTERS and values:
            sizes.as_text(values[0])
        if name == "join" and len(values) > 1 and isinstance(values[1], str):
            if len(values[1]) * _count(values[0]) > budget.LIMITS.chars:
                raise budget.too_long("the joined string")
        elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
            sizes.grown_by_replace(*values[:3])
        elif name == "format" and values and isinstance(values[0], str):
            sizes.check_percent_format(values[0], tuple(values[1:]))
        return sizes.sized(fn(*args, **kwargs))

    bounded.__name__ = getattr(fn, "__name__", name)
    bounded.__dict__.update(getattr(fn, "__dict__", {}))  # pass_context and its kin
    return bounded


def _count(value: Any) -> int:
    """len(value), or 0 for what has none (a join filter's items are counted where they can be)."""
    try:
        return len(value)
    except TypeError:
        return 0


def _range(*args: int) -> range:
    """range() within the limit, as Jinja's sandbox bounds it, but refused as a request error that names it."""
    rng = range(*args)
    if len(rng) > budget.LIMITS.range_items:
        raise TemplateBudgetError(f"range() of {len(rng):,} items is over the chat template's limit of "
                                  f"{budget.LIMITS.range_items:,}")
    return rng


def _each(iterable: Any) -> Iterator[Any]:
    """A loop's items, each counted against the render's budget (a loop of loops is stopped, not run out)."""
    for item in iterable:
        budget.count_item()
        yield item


def _joined(parts: list) -> str:
    """`a ~ b`: the parts bounded before they are written out as text."""
    sizes.as_text(parts, "a string the template builds with ~")
    return "".join(map(str, parts))


def _concat(pieces) -> str:
    """A block's text (a macro's, a {% set %} block's, a call's caller()): counted before it is joined."""
    pieces = list(pieces)
    if sum(len(p) for p in pieces) > budget.LIMITS.chars:
        raise budget.too_long("a block's text")
    return "".join(pieces)


def _finalize(value: Any) -> Any:
    """Every {{ ... }} is bounded before it is written out as text."""
    return sizes.as_text(value, "an expression's text")


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


_LOADS = {nodes.Include: "include", nodes.Import: "import", nodes.FromImport: "from ... import",
          nodes.Extends: "extends"}  # a tag that loads another template, and how a template writes it


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
        """The parsed template, refused if it would load another, with its loops and `~` metered."""
        tree = super()._parse(source, name, filename)
        loads = next(tree.find_all(tuple(_LOADS)), None)
        if loads is not None:
            raise RequestError(f"the chat template uses {{% {_LOADS[type(loads)]} %}} (line "
                               f"{loads.lineno}): a chat template may not include, import or extend another, as "
                               "there is none to load; write it as one template")
        return _Metered().visit(tree)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget.tick()
        sizes.before_binop(operator, left, right)
        return sizes.sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's own names)
        budget.tick()
        sizes.check_str_call(__obj, args, kwargs)
        return sizes.sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget.tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any):
        """str.format with its widths and arguments bounded, as % is."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            sizes.check_format_widths(fmt)
            sizes.check_args(args, kwargs)
            return sizes.sized(wrapped(*args, **kwargs))

        return bounded
