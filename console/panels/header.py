"""The header line: which model runs where, and the engine flags in force."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.config import EngineConfig
from nanoserve.stats import EngineStats


def header_text(stats: EngineStats) -> str:
    """Which model, where, in what numbers (as the engine built it: weights, activations, KV cache), and the
    flags. A server too old to publish its numerics shows its model dtype."""
    numerics = stats.numerics.text() if stats.numerics is not None else stats.dtype
    return (f"{stats.model} · {stats.device} · max_model_len {stats.max_model_len}\n{numerics}\n"
            f"{flags_text(stats.flags)}")


def flags_text(flags: dict) -> str:
    """The flags set away from the engine's defaults: every flag is too long for a line on any terminal (it was
    cut mid-list), and the flags screen (f) shows them all. A flag this console does not know is listed."""
    defaults = {spec.name: spec.default for spec in EngineConfig.flag_specs()}
    changed = [f"{k}={v}" for k, v in flags.items() if k != "model" and (k not in defaults or defaults[k] != v)]
    return f"flags: {' '.join(changed)} (others default; f: all)" if changed else "flags: all default (f: all)"


class EngineHeader(TextPanel):
    def show(self, stats: EngineStats | None, where: str = "") -> None:
        """None: the server (`where`) has published no snapshot yet, so no model or flags are claimed for it."""
        self.set_text(header_text(stats) if stats is not None else f"{where}\nno snapshot yet")
