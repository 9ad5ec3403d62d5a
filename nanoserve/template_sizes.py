"""What a chat template's values and operations would build, checked before they are built: a string, a list
or a number past its limit (template_budget.LIMITS) is refused with a TemplateBudgetError that names it. The
sizes are known from the operands (`'a' * n`, `'%20000000s' % x`, `s.ljust(n)`, `sep.join(items)`), so nothing
too big is ever made; template_sandbox.py calls these on every operator, call and filter."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from nanoserve import template_budget as budget
from nanoserve.template_budget import TemplateBudgetError


def chars_of(value: Any) -> int:
    """About how many characters `value` is as text, counted only until it passes the limit (so a list of a
    huge string many times is found out at its first items, before anything writes it out)."""
    limit, total, seen, stack = budget.LIMITS.chars, 0, 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        seen += 1
        if seen % 4096 == 0:
            budget.tick()
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
    """`'%20000000s' % x` (and the format filter) build as wide a string as they are told: bound the widths."""
    for match in _PERCENT_WIDTH.finditer(fmt):
        for width in match.groups():
            if width and width != "*" and int(width) > budget.LIMITS.chars:
                raise budget.too_long(f"a {width}-character field")
    check_args(args if isinstance(args, tuple) else (args,), {})


def check_args(args: tuple, kwargs: dict) -> None:
    """Arguments that set a size (a width, a count) within the limit, and none too big to write out."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > budget.LIMITS.chars:
            raise TemplateBudgetError(f"{a:,} is over the chat template's limit of {budget.LIMITS.chars:,} "
                                      "characters for a width or count")
        as_text(a, "an argument")


def check_str_call(method: Any, args: tuple, kwargs: dict) -> None:
    """String methods whose result can outgrow their inputs: bound it before it is built."""
    name = getattr(method, "__name__", "")
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in ("ljust", "rjust", "center", "zfill", "expandtabs"):
        check_args(args, kwargs)
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple)) else sized(list(args[0]))
        as_text(items)
        if len(owner) * len(items) > budget.LIMITS.chars:
            raise budget.too_long("the joined string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grown_by_replace(owner, args[0], args[1])
    elif name in ("translate", "maketrans"):
        raise TemplateBudgetError(f"str.{name} is not available to chat templates; use replace")


def grown_by_replace(text: str, old: str, new: str) -> None:
    """`text.replace(old, new)` refused if the result would be past the limit (an empty `old` matches between
    every character)."""
    count = text.count(old) if old else len(text) + 1
    if len(text) + count * max(0, len(new) - len(old)) > budget.LIMITS.chars:
        raise budget.too_long("the replaced string")


def check_format_widths(fmt: str) -> None:
    """`'{:20000000}'.format(x)` builds as wide a string as it is told: bound the widths in its fields."""
    try:
        specs = "".join(spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec)
    except ValueError:  # not a format string str.format could use: it raises its own error
        return
    for match in re.finditer(r"\d+", specs):
        if int(match.group()) > budget.LIMITS.chars:
            raise budget.too_long(f"a {match.group()}-character field")
