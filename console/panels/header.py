"""The header line: which model runs where, and the engine flags in force."""

from __future__ import annotations

from textual.widgets import Static

from nanoserve.stats import EngineStats


class EngineHeader(Static):
    def __init__(self, **kwargs):
        super().__init__("", markup=False, **kwargs)

    def show(self, stats: EngineStats) -> None:
        flags = " ".join(f"{k}={v}" for k, v in stats.flags.items() if k != "model")
        self.update(f"{stats.model} · {stats.device} · {stats.dtype} · max_model_len {stats.max_model_len}\n"
                    f"flags: {flags}")
