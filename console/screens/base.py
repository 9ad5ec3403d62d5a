"""ConsoleScreen: what every console screen shows around its body (the flags in force, the engine's state, keys)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from console.panels.header import EngineHeader


class ConsoleScreen(Screen):
    """Header (model, device, flags in force) and status line on top, footer below, `compose_body` between.

    The header and status follow the app's engine on the app's refresh interval, so the flags in force stay
    visible on every screen, through restarts. Esc takes the focus off a text field, so the letter keys
    (screens, quit, help) work again.
    """

    BINDINGS = [Binding("escape", "blur", "Unfocus", show=False, id="blur")]
    AUTO_FOCUS = ""  # nothing focused on arrival (matches no widget), so the letter keys answer until a field is chosen

    def action_blur(self) -> None:
        self.set_focus(None)

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        yield Static("", markup=False, id="status")
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        """Textual runs every class's on_mount, so subclasses add their own without calling this one."""
        self.start_refresh()

    def start_refresh(self) -> None:
        """Follow the engine on the app's refresh interval (the dashboard replaces this with its own tick)."""
        self.refresh_header()
        self.set_interval(self.app.refresh_s, self.refresh_header)

    def status_text(self) -> str:
        return self.app.status_line()

    def show_status(self) -> None:
        status = self.query_one("#status", Static)
        text = self.status_text()
        if text != str(status.content):  # an unchanged line costs no repaint
            status.update(text)

    def refresh_header(self) -> None:
        self.show_status()
        server = self.app.server
        if server is not None:
            self.query_one(EngineHeader).show(server.host.stats())
