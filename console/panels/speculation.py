"""The Speculation panel: what speculative decoding drafted and kept, since start and over the last WINDOW_S
seconds (the difference between the latest snapshot and the oldest one kept inside the window), and where it
stood down. Hidden, like the other feature panels, while the engine publishes no `speculative` section."""

from __future__ import annotations

from collections import deque
from time import monotonic

from console.numbers import count, decimal
from console.panels.features import OFF, FeaturePanel
from nanoserve.stats import EngineStats

WINDOW_S = 10.0
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _rates(drafts: int, drafted: int, kept: int) -> str:
    if not drafts:
        return "no drafts"
    return (f"{count(drafts)} drafts, {decimal(100 * kept / drafted)}% of {count(drafted)} drafted tokens kept, "
            f"{decimal(1 + kept / drafts, 2)} tokens a drafting step")


def speculation_text(spec: dict, window: tuple[int, int, int] | None) -> str:
    """The section's lines: method, totals, the window's rates, per-position acceptance and stand-downs."""
    lines = [f"{spec['method']}, up to {spec['num_speculative_tokens']} drafted tokens a step",
             "since start: " + _rates(*(spec[k] for k in COUNTERS))]
    if window is not None:
        lines.append(f"last {WINDOW_S:.0f} s: " + _rates(*window))
    if spec["num_drafts"]:
        kept = spec["num_accepted_tokens_per_pos"]
        lines.append("kept by position: " + " ".join(f"{decimal(100 * n / spec['num_drafts'])}%" for n in kept))
    lines.append(f"stood down: {count(spec['stood_down_steps'])} crowded steps, "
                 f"{count(spec['stood_down_requests'])} requests keeping too few, "
                 f"{count(spec['grammar_cut_tokens'])} drafted tokens cut by a grammar")
    return "\n".join(lines)


class SpeculationPanel(FeaturePanel):
    def __init__(self, **kwargs):
        super().__init__("speculative", **kwargs)
        self._marks: deque[tuple[float, tuple[int, ...]]] = deque()

    def show(self, stats: EngineStats) -> None:
        spec = stats.features.get("speculative")
        self.published = spec is not None
        if spec is None:
            self._marks.clear()
            self.set_text(OFF)
            return
        now, totals = monotonic(), tuple(spec[k] for k in COUNTERS)
        if self._marks and totals < self._marks[-1][1]:  # the engine restarted: its counters began again
            self._marks.clear()
        self._marks.append((now, totals))
        while len(self._marks) > 2 and now - self._marks[1][0] >= WINDOW_S:
            self._marks.popleft()
        oldest = self._marks[0][1]
        window = tuple(a - b for a, b in zip(totals, oldest)) if len(self._marks) > 1 else None
        self.set_text(speculation_text(spec, window))
