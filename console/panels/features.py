"""Capture and persistent-input panels: they show whatever section the engine publishes under their name."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.stats import EngineStats

OFF = "off (not published by this engine)"


class FeaturePanel(TextPanel):
    """Shows `stats.as_dict()[section]` key by key, or OFF while the engine publishes no such section."""

    def __init__(self, section: str, **kwargs):
        super().__init__(OFF, **kwargs)
        self.section = section

    def show(self, stats: EngineStats) -> None:
        published = stats.as_dict().get(self.section)
        if published is None:
            self.set_text(OFF)
        elif isinstance(published, dict):
            self.set_text("\n".join(f"{k:<12} {v}" for k, v in published.items()) or "(empty)")
        else:
            self.set_text(str(published))
