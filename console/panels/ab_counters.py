"""The A/B screen's counters as rows of counter | A | B | diff, each cell short enough that the table fits in
100 columns: a long value (a list of stall entries, a mapping of kernels) is summarised, never printed whole.

Also the A/B's wording of a refused flag set: the engine's checks name CLI flags (`--no-batch-invariant`), but on
the A/B screen flags are typed NAME=VALUE, so the refusal names them that way (`batch_invariant=off`)."""

from __future__ import annotations

import re

from nanoserve.ab import show
from nanoserve.config import EngineConfig

CELL = 20  # the widest an A or B cell gets
NAME = 34  # the widest a counter's name gets


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def cell(value, name: str = "") -> str:
    """A counter's value in at most CELL characters: lists as their length, mappings whole when short, else
    their size."""
    if isinstance(value, (list, tuple)):
        return "none" if not value else f"{len(value):,} {'entry' if len(value) == 1 else 'entries'}"
    if isinstance(value, dict):
        whole = show(value, name)
        return whole if len(whole) <= CELL else f"{len(value):,} keys"
    return clip(show(value, name), CELL)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def diff(a, b) -> str:
    """B against A: 'same', a signed change for numbers (with its share of A), 'differs' otherwise."""
    if a == b:
        return "same"
    if _number(a) and _number(b):
        change = b - a
        text = f"{change:+,}" if isinstance(change, int) else f"{change:+,.3g}"
        return f"{text} ({100 * change / a:+.0f}%)" if a else text
    if a is None or b is None:
        return "only B" if a is None else "only A"
    return "differs"


def counter_cells(rows) -> list[tuple[str, str, str, str]]:
    """(counter, A, B, diff) from ABResult.counter_rows()."""
    return [(clip(name, NAME), cell(a, name), cell(b, name), diff(a, b)) for name, a, b in rows]


_FLAG = re.compile(r"--(no-)?([a-z][a-z0-9-]*)(?: ([^\s,;)]+))?")


def ab_form(message: str) -> str:
    """A refusal in the A/B's NAME=VALUE form: '--no-batch-invariant' reads 'batch_invariant=off', '--device cpu'
    reads 'device=cpu'. Words that are not engine flags stay as they are."""
    specs = {spec.name: spec for spec in EngineConfig.flag_specs()}

    def swap(match: re.Match) -> str:
        no, name, value = match.group(1), match.group(2).replace("-", "_"), match.group(3)
        spec = specs.get(name)
        if spec is None:
            return match.group(0)
        after = f" {value}" if value is not None else ""
        if spec.kind is bool:
            return f"{name}={'off' if no else 'on'}{after}"
        if value is not None:
            try:
                spec.parse(value)
            except ValueError:
                return f"{name}{after}"
            return f"{name}={value}"
        return name

    return _FLAG.sub(swap, message)
