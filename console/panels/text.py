"""TextPanel: a Static that repaints only when its text changes (most ticks change few panels)."""

from __future__ import annotations

from textual.widgets import Static


class TextPanel(Static):
    def __init__(self, text: str = "", **kwargs):
        super().__init__(text, markup=False, **kwargs)
        self._text = text

    def set_text(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self.update(text)
