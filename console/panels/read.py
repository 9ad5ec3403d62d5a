"""The paged read: which read runs, and the score cells it is charged against the cells it holds."""

from __future__ import annotations

from console.numbers import count
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


class ReadPanel(TextPanel):
    def show(self, stats: EngineStats) -> None:
        self.set_text(read_text(stats))


def read_text(stats: EngineStats) -> str:
    read = stats.paged_read
    block = "-" if read.block is None else read.block
    return (
        f"mode         {read.mode}  block {block}\n"
        f"calls        {count(read.calls)}  rows {count(read.rows)}\n"
        f"score cells  {count(read.score_cells)}\n"
        f"held cells   {count(read.held_cells)}\n"
        f"saving       {read.saving:.3f} (charged / held)"
    )
