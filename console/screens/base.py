"""ConsoleScreen: what every console screen shows around its body (the flags in force, the engine's state, keys)."""

from __future__ import annotations

from collections.abc import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input

from console.panels.header import EngineHeader
from console.panels.servers import ServerTabs
from console.panels.text import TextPanel

NARROW = 130  # columns below which screens take their narrow layout


def positive_int(field: Input | str, label: str) -> int:
    """A whole number >= 1 from a text field (or its text); ValueError naming `label` otherwise."""
    text = (field if isinstance(field, str) else field.value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{label} must be a whole number >= 1, got {text!r}")
    return int(text)


class ConsoleScreen(Screen):
    """Header (model, device, flags in force) and status line on top, footer below, `compose_body` between.

    The header and status follow the app's engine on the app's refresh interval, so the flags in force stay
    visible on every screen, through restarts. Esc takes the focus off a text field, so the letter keys
    (screens, quit, help) work again.

    Every screen is an app mode, and switching modes only suspends the screen left, so its timers would keep
    firing: screens poll with `every_while_shown`, whose timers pause while the screen is out of view.
    """

    # shown in the footer only while a text field has the focus: it is what gives the letter keys back
    BINDINGS = [Binding("escape", "blur", "Leave field: keys", id="blur")]
    AUTO_FOCUS = ""  # nothing focused on arrival (matches no widget), so the letter keys answer until a field is chosen

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._shown_timers: list[tuple[Timer, Callable[[], object]]] = []

    def action_blur(self) -> None:
        self.set_focus(None)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Esc appears in the footer while a text field holds the letter keys, and not otherwise."""
        if action == "blur":
            return isinstance(self.focused, Input)
        return True

    def on_resize(self, event) -> None:
        """Below NARROW columns: the screen's narrow layout, and a compact footer without the palette's key (the
        palette still opens with ctrl+p, and help lists it), so every key stays in view."""
        narrow = event.size.width < NARROW
        self.set_class(narrow, "-narrow")
        footer = self.query_one(Footer)
        footer.compact, footer.show_command_palette = narrow, not narrow

    def on_descendant_focus(self, event) -> None:
        self.refresh_bindings()

    def on_descendant_blur(self, event) -> None:
        self.refresh_bindings()

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        if self.app.attached and len(self.app.watched) > 1:
            yield ServerTabs(self.app.watched, id="servers")
        yield TextPanel(id="status")
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        """Textual runs every class's on_mount, so subclasses add their own without calling this one."""
        self.start_refresh()

    # ---- timers that run only while the screen is in view -------------------------------------------
    def every_while_shown(self, interval: float, callback: Callable[[], object]) -> Timer:
        """`set_interval` for polling the screen's view: paused while the screen is out of view (another mode
        is shown; a modal over it leaves it in view), and on return restarted and called at once."""
        timer = self.set_interval(interval, callback)
        self._shown_timers.append((timer, callback))
        return timer

    def on_screen_suspend(self) -> None:
        if not self.is_current:
            for timer, _ in self._shown_timers:
                timer.pause()

    def on_screen_resume(self) -> None:
        for timer, callback in self._shown_timers:
            timer.resume()
            timer.reset()  # a full interval from now, rather than the tick held back while paused
            callback()

    # ---- header and status --------------------------------------------------------------------------
    def start_refresh(self) -> None:
        """Follow the engine on the app's refresh interval (the dashboard replaces this with its own tick)."""
        self.refresh_header()
        self.every_while_shown(self.app.refresh_s, self.refresh_header)

    def status_text(self) -> str:
        return self.app.status_line()

    def show_status(self) -> None:
        for tabs in self.query(ServerTabs):
            tabs.follow(self.app.selected)
        # The phase clock's timer can tick between a screen's push and its compose: no status line yet, none to set.
        for status in self.query("#status").results(TextPanel):
            status.set_text(self.status_text())  # an unchanged line costs no repaint
            status.set_class(self.app.load_error is not None or not self.app.phase == "serving" and self.app.attached,
                             "failed")

    def refresh_header(self) -> None:
        self.show_status()
        server = self.app.server
        if server is not None:  # its stats are None while an attached server has not answered yet
            self.query_one(EngineHeader).show(server.host.stats(), server.url)
