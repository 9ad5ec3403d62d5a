"""What a chat template's values and operations would build, checked before they are built: a string, a list
or a number past its limit (template_budget.LIMITS) is refused with a TemplateBudgetError that names it. The
sizes are known from the operands (`'a' * n`, `'%20000000s' % x`, `s.ljust(n)`, `sep.join(items)`), so nothing
too big is ever made; template_sandbox.py calls these on every operator, call and filter."""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Mapping
from typing import Any

from nanoserve import template_budget as budget
from nanoserve.template_budget import TemplateBudgetError


def chars_of(value: Any, per_item: int = 0, per_depth: int = 0) -> int:
    """About how many characters `value` is as text, counted only until it passes the limit (so a list of a
    huge string many times is found out at its first items, before anything writes it out). Each item adds
    `per_item` more, and `per_depth` for each level it is nested at (the separators and indentation of JSON
    or pprint written with them)."""
    limit, total, seen, stack = budget.LIMITS.chars, 0, 0, [(value, 0)]
    while stack and total <= limit:
        v, depth = stack.pop()
        seen += 1
        if seen % 4096 == 0:
            budget.tick()
        total += per_item + per_depth * depth
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            total += 2 + 2 * len(v) + per_item * len(v)
            stack.extend((x, depth + 1) for pair in v.items() for x in pair)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + len(v)
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 1
        else:
            total += 8
    return total


def as_text(value: Any, what: str = "a value the template writes out") -> Any:
    """`value`, refused if written out as text it would be past the limit."""
    if not isinstance(value, (int, float, bool)) and chars_of(value) > budget.LIMITS.chars:
        raise budget.too_long(what)
    return value


def sized(value: Any) -> Any:
    """`value`, refused if it is a string, list or number past its limit (a cheap check: made on everything a
    call, filter or operator returns)."""
    if isinstance(value, str):
        if len(value) > budget.LIMITS.chars:
            raise budget.too_long("a string the template builds")
        budget.count_built(len(value))
    elif isinstance(value, (list, tuple, dict, set)):
        if len(value) > budget.LIMITS.items:
            raise budget.too_many(len(value))
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > budget.LIMITS.int_bits:
        raise budget.too_big()
    return value


def before_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*` and `**` whose results are too big to build (the size is known from the operands), and `%`
    formats too wide."""
    ints = isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool)
    if operator == "*" and ints:
        if left.bit_length() + right.bit_length() > budget.LIMITS.int_bits:
            raise budget.too_big()
    elif operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, str) and isinstance(n, int) and len(seq) * n > budget.LIMITS.chars:
            raise budget.too_long(f"a string * {n:,}")
        if isinstance(seq, (list, tuple)) and isinstance(n, int) and len(seq) * n > budget.LIMITS.items:
            raise budget.too_many(len(seq) * n)
    elif operator == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > budget.LIMITS.int_bits:
            raise budget.too_big()
    elif operator == "%" and isinstance(left, str):
        check_percent_format(left, right)


_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def check_percent_format(fmt: str, args: Any) -> None:
    """`'%20000000s' % x` (and the format filter) build as wide a string as they are told: the widths of all
    its fields together, and its arguments together, within the limit."""
    fields = [w for match in _PERCENT_WIDTH.finditer(fmt) for w in match.groups() if w]
    _check_widths([int(w) for w in fields if w != "*"])
    check_args(args if isinstance(args, tuple) else (args,), {}, counts="*" in fields)


def check_format_widths(fmt: str) -> bool:
    """`'{:20000000}'.format(x)` builds as wide a string as it is told: the widths in all its fields together
    within the limit. Says whether a width comes from the arguments (`{:{}}`)."""
    try:
        specs = "".join(spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec)
    except ValueError:  # not a format string str.format could use: it raises its own error
        return False
    _check_widths([int(w) for w in re.findall(r"\d+", specs)])
    return "{" in specs


def _check_widths(widths: list[int]) -> None:
    if sum(widths) > budget.LIMITS.chars:
        raise budget.too_long(f"a format's fields ({sum(widths):,} characters wide)")


def check_args(args: tuple, kwargs: dict, counts: bool = True) -> None:
    """A call's arguments: those that set a size (a width, a count; `counts`) within the limit, and all of
    them together not too big to write out."""
    values = (*args, *kwargs.values())
    for a in values if counts else ():
        if isinstance(a, int) and not isinstance(a, bool) and a > budget.LIMITS.chars:
            raise TemplateBudgetError(f"{a:,} is over the chat template's limit of {budget.LIMITS.chars:,} "
                                      "characters for a width or count")
    as_text(values, "the arguments")


def check_str_call(method: Any, args: tuple, kwargs: dict) -> None:
    """String methods whose result can outgrow their inputs: bound it before it is built."""
    name = getattr(method, "__name__", "")
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in ("ljust", "rjust", "center", "zfill"):
        check_args(args, kwargs)
    elif name == "expandtabs":
        tab = (args or tuple(kwargs.values()) or (8,))[0]
        if isinstance(tab, int) and len(owner) + owner.count("\t") * tab > budget.LIMITS.chars:
            raise budget.too_long("the string with its tabs expanded")
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else sized(list(bounded_items(args[0])))
        as_text(items)
        if len(owner) * len(items) > budget.LIMITS.chars:
            raise budget.too_long("the joined string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grown_by_replace(owner, args[0], args[1])
    elif name in ("split", "rsplit", "splitlines"):
        _check_pieces(owner, name, args, kwargs)
    elif name in ("translate", "maketrans"):
        raise TemplateBudgetError(f"str.{name} is not available to chat templates; use replace")


def _check_pieces(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """A split into more pieces than a list may have is refused before the pieces are made."""
    sep = args[0] if args and name != "splitlines" else kwargs.get("sep")
    if name == "splitlines":
        pieces = text.count("\n") + 1
    elif isinstance(sep, str) and sep:
        pieces = text.count(sep) + 1
    else:  # on whitespace: the result is sized once made
        return
    if pieces > budget.LIMITS.items:
        raise budget.too_many(pieces)


def grown_by_replace(text: str, old: str, new: str) -> None:
    """`text.replace(old, new)` refused if the result would be past the limit (an empty `old` matches between
    every character)."""
    count = text.count(old) if old else len(text) + 1
    if len(text) + count * max(0, len(new) - len(old)) > budget.LIMITS.chars:
        raise budget.too_long("the replaced string")


def bounded_items(iterable: Any) -> Iterator[Any]:
    """The items of something without a length (a filter's generator), refused past the list limit as they
    come, and the clock looked at as they do."""
    for n, item in enumerate(iterable, 1):
        if n > budget.LIMITS.items:
            raise budget.too_many(n)
        if n % 4096 == 0:
            budget.tick()
        yield item


_WIDTH_FILTERS = ("center", "truncate")  # an argument sets the result's width
_TEXT_FILTERS = ("join", "string", "sum", "format", "xmlattr")  # the value written out as text
# a result (or a list made) per item of the value: one without a length (a generator) is read into a list,
# counted as it is read, before the filter runs
ITEM_FILTERS = frozenset({"batch", "slice", "list", "map", "select", "reject", "selectattr", "rejectattr",
                          "unique", "sort", "groupby", "dictsort", "items", "reverse", "join"})


def check_filter(name: str, values: list, kwargs: dict) -> None:
    """A built-in filter's result bounded before it is made, from its value (values[0]) and arguments."""
    if name in _WIDTH_FILTERS:
        check_args(tuple(values[1:]), kwargs)
    if name in _TEXT_FILTERS and values:
        as_text(values[0])
    if not values:
        return
    if name in ITEM_FILTERS and hasattr(values[0], "__len__") and len(values[0]) > budget.LIMITS.items:
        raise budget.too_many(len(values[0]))
    if name == "join" and len(values) > 1 and isinstance(values[1], str):
        if len(values[1]) * len(values[0]) > budget.LIMITS.chars:
            raise budget.too_long("the joined string")
    elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
        grown_by_replace(*values[:3])
    elif name == "format" and isinstance(values[0], str):
        check_percent_format(values[0], tuple(values[1:]))
    elif name in ("indent", "wordwrap"):
        _check_wrapped(name, values, kwargs)
    elif name in ("tojson", "pprint"):
        _check_written(name, values, kwargs)


def _argument(values: list, kwargs: dict, position: int, name: str, default: Any) -> Any:
    """A filter's argument, given by position (after the value) or by name."""
    return values[position] if len(values) > position else kwargs.get(name, default)


def _check_wrapped(name: str, values: list, kwargs: dict) -> None:
    """indent writes its width on every line, wordwrap its wrapstring at every break: bound what they add."""
    text = values[0] if isinstance(values[0], str) else str(values[0])
    if name == "indent":
        width = _argument(values, kwargs, 1, "width", 4)
        added, times = (len(width) if isinstance(width, str) else width), text.count("\n") + 1
    else:
        width = _argument(values, kwargs, 1, "width", 79)
        wrap = _argument(values, kwargs, 3, "wrapstring", None)
        added = len(wrap) if isinstance(wrap, str) else 1
        times = 2 * len(text) // max(1, width if isinstance(width, int) else 1) + 1  # lines, two by two > width
    if isinstance(added, int) and len(text) + times * added > budget.LIMITS.chars:
        raise budget.too_long(f"the text with its {name}")


def _check_written(name: str, values: list, kwargs: dict) -> None:
    """JSON with an indent (or pprint) writes each item on its own line, indented by its depth, and separators
    between: bound the text with all of them."""
    if name == "pprint":
        per_item, per_depth = 2, 1
    else:
        indent = _argument(values, kwargs, 2, "indent", None)
        separators = _argument(values, kwargs, 3, "separators", None)
        per_depth = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        per_item = (indent is not None) + 2
        if isinstance(separators, (list, tuple)):
            per_item += sum(len(p) for p in separators if isinstance(p, str))
    if chars_of(values[0], per_item, per_depth) > budget.LIMITS.chars:
        raise budget.too_long(f"the {name} text")
