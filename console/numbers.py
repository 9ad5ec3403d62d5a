"""One way to write every number the console shows: thousands separators, units, bytes in MiB/GiB, and a count
per reason instead of a Python dict."""

from __future__ import annotations

from collections.abc import Mapping


def count(n: int | float | None) -> str:
    """1,234,567 (and '-' for a value not known yet)."""
    if n is None:
        return "-"
    return f"{n:,.0f}" if isinstance(n, float) else f"{n:,}"


def decimal(x: float | None, places: int = 1) -> str:
    """1,313.6: a rate or a duration, separated like the counts."""
    return "-" if x is None else f"{x:,.{places}f}"


def size(n_bytes: int | float) -> str:
    """Bytes as KiB, MiB or GiB (whichever keeps the number below 1,024)."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def by_reason(counts: Mapping[str, int]) -> str:
    """'stop 3 · length 8 · abort 1' (most common first); 'none yet' when there are none."""
    shown = [f"{reason} {count(n)}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return " · ".join(shown) if shown else "none yet"
