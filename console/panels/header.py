"""The header line: which model runs where, and the engine flags in force."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


class EngineHeader(TextPanel):
    def show(self, stats: EngineStats) -> None:
        flags = " ".join(f"{k}={v}" for k, v in stats.flags.items() if k != "model")
        self.set_text(f"{stats.model} · {stats.device} · {stats.dtype} · max_model_len {stats.max_model_len}\n"
                    f"flags: {flags}")
