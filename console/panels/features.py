"""Capture, persistent-input and linear-kernel panels: they show whatever sections the engine publishes under
their names."""

from __future__ import annotations

from console.numbers import count, decimal, size
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats

OFF = "off (not published by this engine)"


class FeaturePanel(TextPanel):
    """Shows `stats.features[section]` key by key for each of its sections, or OFF while none is published."""

    def __init__(self, *sections: str, **kwargs):
        super().__init__(OFF, **kwargs)
        self.features = sections
        self.published = False  # whether the last snapshot carried any of its sections

    def show(self, stats: EngineStats) -> None:
        self.published = any(stats.features.get(section) is not None for section in self.features)
        self.set_text(feature_text(stats, self.features) or OFF)


def feature_text(stats: EngineStats, sections) -> str:
    """The published sections key by key ('' when none of them is published)."""
    lines = []
    for section in sections:
        values = stats.features.get(section)
        if isinstance(values, dict):
            lines += [f"{section}:" if len(sections) > 1 else ""] + [f"{k:<18} {shown(k, v)}" for k, v in values.items()]
        elif values is not None:
            lines.append(f"{section}: {values}")
    return "\n".join(line for line in lines if line)


# what None means under a key, where "-" (not known yet / not set) would mislead
NONE_MEANS = {"dense_from_rows": "never"}  # no dense copy: every call runs the packed kernel


def shown(key: str, value, none: str | None = None) -> str:
    """A published value as the console writes numbers: counts separated, bytes in MiB/GiB, a mapping as
    'name value' pairs (never a Python dict), None as the word it means under `key` ("-" when nothing better),
    booleans as on / off."""
    if value is None:
        return none or NONE_MEANS.get(key, "-")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return size(value) if key.endswith("bytes") else count(value)
    if isinstance(value, float):
        return decimal(value)
    if isinstance(value, dict):
        return " · ".join(f"{k} {shown(str(k), v, NONE_MEANS.get(key))}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(key, v) for v in value) or "-"
    return str(value)
