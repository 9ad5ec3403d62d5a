"""The header line: which model runs where, and the engine flags in force."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


def header_text(stats: EngineStats) -> str:
    """Which model, where, in what numbers (as the engine built it: weights, activations, KV cache), and the
    flags. A server too old to publish its numerics shows its model dtype."""
    flags = " ".join(f"{k}={v}" for k, v in stats.flags.items() if k != "model")
    numerics = stats.numerics.text() if stats.numerics is not None else stats.dtype
    return (f"{stats.model} · {stats.device} · max_model_len {stats.max_model_len}\n{numerics}\n"
            f"flags: {flags}")


class EngineHeader(TextPanel):
    def show(self, stats: EngineStats | None, where: str = "") -> None:
        """None: the server (`where`) has published no snapshot yet, so no model or flags are claimed for it."""
        self.set_text(header_text(stats) if stats is not None else f"{where}\nno snapshot yet")
