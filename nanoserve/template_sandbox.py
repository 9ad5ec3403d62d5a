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


_CONTEXTS = (jinja2.runtime.Context, nodes.EvalContext, jinja2.Environment)  # what a filter may be passed first


def _sized_filter(name: str, fn):
    """A filter with its arguments bounded before and its result after (template_sizes.check_filter)."""

    def bounded(*args, **kwargs):
        budget.tick()
        first = next((i for i, a in enumerate(args) if not isinstance(a, _CONTEXTS)), len(args))
        if name in sizes.ITEM_FILTERS and first < len(args) and not hasattr(args[first], "__len__"):
            args = (*args[:first], list(sizes.bounded_items(args[first])), *args[first + 1:])
        sizes.check_filter(name, list(args[first:]), kwargs)
        return sizes.sized(fn(*args, **kwargs))

    bounded.__name__ = getattr(fn, "__name__", name)
    bounded.__dict__.update(getattr(fn, "__dict__", {}))  # pass_context and its kin
    return bounded


def _added(left: str, right: str) -> str:
    """`a + b` of two strings, as templates join their markup: sized from the operands, as `sized` would."""
    size = len(left) + len(right)
    if size > budget.LIMITS.chars:
        raise budget.too_long("a string the template builds")
    budget.count_built(size)
    return left + right


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
    return sizes.sized("".join(map(str, parts)))


def _concat(pieces) -> str:
    """A block's text (a macro's, a {% set %} block's, a call's caller()): counted before it is joined."""
    pieces = list(pieces)
    if sum(len(p) for p in pieces) > budget.LIMITS.chars:
        raise budget.too_long("a block's text")
    return sizes.sized("".join(pieces))


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
        self.filters.pop("urlize", None)  # writes several times its input, and no template uses it
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
        """`*`, `**`, `+` and `%`, refused before a result too big is built, and sized after."""
        if operator == "+" and type(left) is str and type(right) is str:  # noqa: E721 (the common case, made fast)
            return _added(left, right)
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
            sizes.check_args(args, kwargs, counts=sizes.check_format_widths(fmt))
            return sizes.sized(wrapped(*args, **kwargs))

        return bounded
