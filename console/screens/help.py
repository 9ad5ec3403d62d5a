"""The help screen: every key of the console, read from the BINDINGS of the app and of each screen.

Help is generated, not written: a binding added to a screen appears here by itself, so the list cannot drift from
the keys (tests/test_console_screens.py checks every binding is listed). The screen in view comes first.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.keys import format_key
from textual.screen import ModalScreen
from textual.widgets import Static

Section = tuple[str, list[Binding]]  # (heading, its bindings)

# keys that are not bindings of a screen: a widget's own, or the app's built-in ones
WIDGET_KEYS = [
    ("enter", "on a Requests row (dashboard): that request's screen"),
    ("tab", "next control; into a panel area, then arrows / PageDown scroll it"),
    ("ctrl+p", "command palette: every action by name"),
]


def key_text(binding: Binding, keymap: dict[str, str]) -> str:
    """The key as typed: a --keymap remap wins over the binding's own key; several keys joined with '/'."""
    keys = keymap.get(binding.id or "", None) or binding.key
    if binding.key_display and keys == binding.key:
        return binding.key_display
    return " / ".join(format_key(key.strip()) for key in keys.split(","))


def help_lines(sections: list[Section], keymap: dict[str, str]) -> list[str]:
    lines = []
    for heading, bindings in sections:
        if not bindings:
            continue
        lines += ["", heading]
        lines += [f"  {key_text(b, keymap):<11} {b.description or b.action:<22} id {b.id}" for b in bindings]
    lines += ["", "Other keys"] + [f"  {format_key(key):<11} {what}" for key, what in WIDGET_KEYS]
    lines += ["", "A text field takes every letter you type, the screen keys too: esc leaves it, and they work "
              "again (the footer shows esc while a field has the focus).",
              "Remap a key: nanoserve-console --keymap ID=KEY"]
    return lines[1:]


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark", "dismiss", "Close help", id="close_help")]

    def __init__(self, sections: list[Section], keymap: dict[str, str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.sections, self.keymap = sections, keymap or {}

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):  # taller than a small terminal: it scrolls
            yield Static("nanoserve console: keys (esc or ? closes)", id="help-title")
            yield Static("\n".join(help_lines(self.sections, self.keymap)), markup=False, id="help-keys")
