"""The engine log: the engine's and the console's log lines as they arrive, newest at the bottom."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import RichLog

from console.logs import KEEP
from console.screens.base import ConsoleScreen


class LogScreen(ConsoleScreen):
    BINDINGS = [Binding("x", "clear_log", "Clear", id="clear_log")]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0

    def compose_body(self) -> ComposeResult:
        yield RichLog(id="log", max_lines=KEEP, markup=False, highlight=False, wrap=True)

    def on_mount(self) -> None:
        self.query_one("#log").border_title = "Engine log"
        self.drain()
        self.every_while_shown(0.25, self.drain)

    def drain(self) -> None:
        self.seen, lines = self.app.engine_log.since(self.seen)
        log = self.query_one("#log", RichLog)
        for line in lines:
            log.write(line)

    def action_clear_log(self) -> None:
        self.query_one("#log", RichLog).clear()
