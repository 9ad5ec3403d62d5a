"""Capture and persistent-input panels: they show whatever section the engine publishes under their name."""

from __future__ import annotations

from textual.widgets import Static

from nanoserve.stats import EngineStats

OFF = "off (not published by this engine)"


class FeaturePanel(Static):
    """Shows `stats.as_dict()[section]` key by key, or OFF while the engine publishes no such section."""

    def __init__(self, section: str, **kwargs):
        super().__init__(OFF, markup=False, **kwargs)
        self.section = section

    def show(self, stats: EngineStats) -> None:
        published = stats.as_dict().get(self.section)
        if published is None:
            self.update(OFF)
        elif isinstance(published, dict):
            self.update("\n".join(f"{k:<12} {v}" for k, v in published.items()) or "(empty)")
        else:
            self.update(str(published))
