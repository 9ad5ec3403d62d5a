"""The Speculation panel: what speculative decoding drafted and kept, since start and over the last WINDOW_S
seconds (the difference between the latest snapshot and the oldest one kept inside the window), the measured speed
of the decode steps that verified drafts against those that did not (the speed-up), and where it stood down.
Hidden, like the other feature panels, while the engine publishes no `speculative` section."""

from __future__ import annotations

from collections import deque
from time import monotonic

from console.numbers import count, decimal
from console.panels.features import OFF, FeaturePanel
from nanoserve.stats import EngineStats

WINDOW_S = 10.0
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
TIMING = ("drafting_steps_s", "drafting_steps_tokens", "plain_steps_s", "plain_steps_tokens")


def _rates(drafts: int, drafted: int, kept: int) -> str:
    if not drafts:
        return "no drafts"
    return (f"{count(drafts)} drafts, {decimal(100 * kept / drafted)}% of {count(drafted)} drafted tokens kept, "
            f"{decimal(1 + kept / drafts, 2)} tokens a drafting step")


def _speed(drafting_s: float, drafting_tokens: int, plain_s: float, plain_tokens: int) -> str:
    """Decode steps with drafts against those without, in tokens a second: measured, both kinds timed."""
    if not drafting_s or not plain_s:
        return ""
    fast, plain = drafting_tokens / drafting_s, plain_tokens / plain_s
    return f"; decode steps with drafts {decimal(fast)} tok/s, without {decimal(plain)}: {decimal(fast / plain, 2)}x"


def speculation_text(spec: dict, window: tuple | None) -> str:
    """The section's lines: method, totals and the window's rates (with the speed of drafting steps against plain
    ones), per-position acceptance and stand-downs. `window` is the COUNTERS then TIMING differences."""
    lines = [f"{spec['method']}, up to {spec['num_speculative_tokens']} drafted tokens a step",
             "since start: " + _rates(*(spec[k] for k in COUNTERS)) + _speed(*(spec.get(k, 0) for k in TIMING))]
    if window is not None:
        lines.append(f"last {WINDOW_S:.0f} s: " + _rates(*window[:3]) + _speed(*window[3:]))
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
        now, totals = monotonic(), tuple(spec.get(k, 0) for k in (*COUNTERS, *TIMING))
        if self._marks and totals < self._marks[-1][1]:  # the engine restarted: its counters began again
            self._marks.clear()
        self._marks.append((now, totals))
        while len(self._marks) > 2 and now - self._marks[1][0] >= WINDOW_S:
            self._marks.popleft()
        oldest = self._marks[0][1]
        window = tuple(a - b for a, b in zip(totals, oldest)) if len(self._marks) > 1 else None
        self.set_text(speculation_text(spec, window))
