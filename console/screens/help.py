"""The help screen: the key bindings of the app and of the screen below it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark", "dismiss", "Close", id="close_help")]

    def __init__(self, bindings: list[Binding], **kwargs):
        super().__init__(**kwargs)
        self.listed = bindings

    def compose(self) -> ComposeResult:
        lines = [f"{b.key_display or b.key:<10} {b.description:<16} id {b.id}" for b in self.listed]
        with Vertical(id="help"):
            yield Static("nanoserve console: keys", id="help-title")
            yield Static("\n".join(lines + [
                "", "A text field takes every letter you type, the screen keys too: esc leaves it, and they work "
                "again (the footer shows esc while a field has the focus).",
                "", "escape / ?  close this help", "ctrl+p      command palette: every action by name",
                "Remap a key: nanoserve-console --keymap ID=KEY"]), markup=False, id="help-keys")
