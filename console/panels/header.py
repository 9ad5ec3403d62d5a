"""The header line: which model runs where, and the engine flags in force."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


def header_text(stats: EngineStats) -> str:
    flags = " ".join(f"{k}={v}" for k, v in stats.flags.items() if k != "model")
    return f"{stats.model} · {stats.device} · {stats.dtype} · max_model_len {stats.max_model_len}\nflags: {flags}"


class EngineHeader(TextPanel):
    def show(self, stats: EngineStats | None, where: str = "") -> None:
        """None: the server (`where`) has published no snapshot yet, so no model or flags are claimed for it."""
        self.set_text(header_text(stats) if stats is not None else f"{where}\nno snapshot yet")
