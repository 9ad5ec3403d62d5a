"""nanoserve-console: the operator's terminal app, an engine and its OpenAI server with screens to watch and steer."""

from __future__ import annotations

import sys
import threading
import time

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message

from console.logs import EngineLog
from console.screens.ab import ABScreen
from console.screens.chat import ChatScreen
from console.screens.dashboard import Dashboard
from console.screens.flags import FlagsScreen
from console.screens.help import HelpScreen
from console.screens.load import LoadScreen
from console.screens.log import LogScreen
from nanoserve.config import EngineConfig

PHASE_TICK_S = 0.25  # how often the status line's phase clock ticks while the engine is not serving

# mode name -> (screen, key, title); every mode is a footer binding and a command-palette entry
SCREENS = {
    "dashboard": (Dashboard, "d", "Dashboard"),
    "flags": (FlagsScreen, "f", "Flags"),
    "load": (LoadScreen, "l", "Load"),
    "chat": (ChatScreen, "c", "Chat"),
    "ab": (ABScreen, "a", "A/B"),
    "log": (LogScreen, "e", "Engine log"),
}


class PhaseChanged(Message):
    """A worker thread says what the engine is doing now (loading, serving, restarting...)."""

    def __init__(self, phase: str, at: float):
        super().__init__()
        self.phase, self.at = phase, at


class LoadFailed(Message):
    """The load thread could not start the engine."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error


class RestartEnded(Message):
    """The restart thread is done: `config` is in force now, or `error` says why the previous flags still are."""

    def __init__(self, config: EngineConfig | None, error: BaseException | None):
        super().__init__()
        self.config, self.error = config, error


class NanoserveConsole(App):
    """Starts a `Server` (engine host + OpenAI API on loopback) in a thread worker; screens watch and steer it.

    State the screens read: `server` (None until loaded), `config` (the flags in force), `phase` (what the
    engine is doing: loading, serving, restarting...), `load_error`, `restart_error`. Worker threads never write
    it: they post messages (PhaseChanged, LoadFailed, RestartEnded) that the app applies on its own thread. The
    one exception is `server`, handed over under a lock so that a load finishing as the app closes is stopped.
    """

    TITLE = "nanoserve console"
    CSS_PATH = "console.tcss"
    MODES = {name: screen for name, (screen, _, _) in SCREENS.items()}
    DEFAULT_MODE = "dashboard"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        *(Binding(key, f"switch_mode('{name}')", title, id=f"screen_{name}") for name, (_, key, title) in SCREENS.items()),
        # attached to several servers: the status line says "[ and ] switch", so the footer keeps its room
        Binding("left_square_bracket", "previous_server", "Previous server", key_display="[", id="previous_server",
                show=False),
        Binding("right_square_bracket", "next_server", "Next server", key_display="]", id="next_server", show=False),
    ]

    def __init__(self, config: EngineConfig, port: int = 0, refresh_s: float = 1.0, servers=()):
        """`servers`: servers to watch instead of starting one (they outlive the app): a running Server, or
        AttachedServers polled over HTTP (`--attach`), one tab each."""
        super().__init__()
        self.config = config
        self.watched = list(servers)
        self.selected = 0  # which watched server the screens show and send to
        self.port = port
        self.refresh_s = refresh_s
        self.server = None  # a nanoserve.server.serve.Server (or an AttachedServer) once loaded
        self.load_error: BaseException | None = None
        self.restart_error: BaseException | None = None
        self.phase = "starting"
        self.phase_since = time.monotonic()
        self.phases: list[tuple[float, str]] = []  # every phase with its start time, for screens that list them
        self.restarts = 0  # finished restarts, successful or not
        self.engine_log = EngineLog()
        self._closing = False
        self._lock = threading.Lock()  # orders "the server is up" against "the app is closing"
        self.load_done = threading.Event()  # set when the load thread has ended, whatever its outcome

    @property
    def attached(self) -> bool:
        """Watching servers that run elsewhere: their flags are set where they run, not here."""
        return any(getattr(server, "attached", False) for server in self.watched)

    def on_mount(self) -> None:
        self._app_thread = threading.get_ident()
        self.engine_log.attach()
        self.run_worker(self._start_server, thread=True, name="server", exit_on_error=False)
        self.set_interval(PHASE_TICK_S, self.tick_phase)
        if self.attached:
            self.set_interval(min(self.refresh_s, 0.5), self.follow_attached)

    def tick_phase(self) -> None:
        """While the engine is not serving (starting, loading, restarting), the status line's clock of the
        current phase ticks on its own timer, whatever the refresh interval, so a long phase shows it is alive."""
        from console.screens.base import ConsoleScreen

        if (self.phase != "serving" or self.server is None) and isinstance(self.screen, ConsoleScreen):
            self.screen.show_status()

    # ---- engine lifecycle (worker threads) ----------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """Called from any thread: on the app's own it applies now, from another it is posted."""
        if threading.get_ident() == getattr(self, "_app_thread", None):
            self._apply_phase(phase, time.monotonic())
        else:
            self.post_message(PhaseChanged(phase, time.monotonic()))

    def on_phase_changed(self, message: PhaseChanged) -> None:
        self._apply_phase(message.phase, message.at)

    def _apply_phase(self, phase: str, at: float) -> None:
        self.phase, self.phase_since = phase, at
        self.phases.append((at, phase))
        self.engine_log.note(f"engine: {phase}")

    def on_load_failed(self, message: LoadFailed) -> None:
        self.load_error = message.error

    def on_restart_ended(self, message: RestartEnded) -> None:
        if message.config is not None:
            self.config = message.config
        self.restart_error = message.error
        self.restarts += 1

    def _start_server(self) -> None:
        try:
            self._load()
        finally:
            self.load_done.set()

    def _load(self) -> None:
        from nanoserve.server.serve import Server

        if self.attached:
            for server in self.watched:
                server.start()
            self.watched[0].host.wait_polled()
        try:
            server = self.watched[0] if self.watched else Server(self.config, port=self.port,
                                                                 progress=self.set_phase).start()
        except Exception as e:  # shown on every screen's status line
            self.post_message(LoadFailed(e))
            self.set_phase(f"failed to load: {e}")
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self.server = server
                self.set_phase(attached_phase(server) if self.attached else "serving")
        if closing and server not in self.watched:  # the app quit while the model loaded
            server.stop()

    @property
    def restarting(self) -> bool:
        return any(w.name == "restart" and not w.is_finished for w in self.workers)

    def restart_engine(self, config: EngineConfig, drain: bool = False) -> None:
        """Swap the engine for one built with `config` in a worker; the server and its port stay up."""
        if self.attached:
            raise RuntimeError(f"attached to {self.server.url}: its flags are set where it runs; restart that "
                               "server with the new flags (nanoserve serve ...)")
        if self.server is None or self.restarting:
            raise RuntimeError("the engine is not serving yet; wait for it before restarting")
        self.restart_error = None
        self.run_worker(lambda: self._restart(config, drain), thread=True, name="restart", exit_on_error=False)

    def _restart(self, config: EngineConfig, drain: bool) -> None:
        try:
            self.server.host.restart(config, drain=drain, progress=self.set_phase)
        except Exception as e:
            self.set_phase(f"serving the previous flags: the restart failed ({e})")
            self.post_message(RestartEnded(None, e))
            return
        self.set_phase("serving")
        self.post_message(RestartEnded(config, None))

    # ---- watching servers that run elsewhere --------------------------------------------------------
    def follow_attached(self) -> None:
        """The phase follows the selected server's last poll (only a change is logged)."""
        server = self.server
        if server is not None:
            phase = attached_phase(server)
            if phase != self.phase:
                self.set_phase(phase)

    def select_server(self, index: int) -> None:
        """Show (and send to) the watched server at `index`; every screen follows on its next tick."""
        if not self.attached or index == self.selected or not 0 <= index < len(self.watched):
            return
        with self._lock:
            if self._closing:
                return
            self.selected, self.server = index, self.watched[index]
        self.follow_attached()
        self.screen.refresh_bindings()

    def action_next_server(self) -> None:
        self.select_server((self.selected + 1) % len(self.watched))

    def action_previous_server(self) -> None:
        self.select_server((self.selected - 1) % len(self.watched))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The server keys appear only while several servers are watched."""
        if action in ("next_server", "previous_server"):
            return len(self.watched) > 1
        return True

    def status_line(self) -> str:
        server, phase = self.server, self.phase
        if self.attached:
            if server is None:
                return f"attaching to {', '.join(s.url for s in self.watched)}… {time.monotonic() - self.phase_since:.1f} s"
            return attached_status(server, self.selected, len(self.watched))
        if server is not None and phase == "serving":
            return f"serving {server.model_name} at {server.url}/v1"
        if self.load_error is not None:
            return (f"the engine did not load: {self.load_error}\nNothing is served. Quit (q) and start again with a "
                    "model that loads; nanoserve-console without --model runs the embedded default model.")
        what = self.config.model or "the embedded default model"
        return f"{what}: {phase}… {time.monotonic() - self.phase_since:.1f} s"

    async def on_unmount(self) -> None:
        import asyncio

        with self._lock:
            self._closing = True
            server, self.server = self.server, None
        if server is not None and server not in self.watched:
            await asyncio.to_thread(server.stop)
        for watched in self.watched:
            if getattr(watched, "attached", False):
                watched.stop()  # its poller only: the server itself runs on
        self.engine_log.detach()

    # ---- actions ------------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(help_sections(self.screen), getattr(self, "_keymap", {})))

    def get_system_commands(self, screen):
        """The command palette (ctrl+p): every screen and every action of the screen in view."""
        yield from super().get_system_commands(screen)
        for name, (_, key, title) in SCREENS.items():
            yield SystemCommand(f"Go to {title}", f"switch to the {title} screen (key {key})",
                                lambda name=name: self.switch_mode(name))
        yield SystemCommand("Help", "list the keys of this screen", self.action_help)
        for binding in screen.BINDINGS:
            if isinstance(binding, Binding) and binding.description:
                yield SystemCommand(binding.description, f"{title_of(screen)}: key {binding.key_display or binding.key}",
                                    lambda b=binding: self.run_action(b.action, screen))


def help_sections(screen) -> list[tuple[str, list[Binding]]]:
    """Every binding, from the BINDINGS of the app and of each screen (the one in view first), for help."""
    from console.screens.base import ConsoleScreen
    from console.screens.flags import ConfirmRestart
    from console.screens.request import RequestScreen

    everywhere = [*NanoserveConsole.BINDINGS, *ConsoleScreen.BINDINGS]
    servers = [b for b in everywhere if b.action.endswith("_server")]
    sections = [("Everywhere", [b for b in everywhere if b not in servers]),
                ("Attached to several servers (--attach twice or more)", servers)]
    screens = [(f"{title} screen ({key})", cls) for cls, key, title in SCREENS.values()]
    screens += [("A request's screen (Enter on a Requests row)", RequestScreen),
                ("Restart confirmation (flags screen)", ConfirmRestart), ("This help", HelpScreen)]
    screens.sort(key=lambda item: not isinstance(screen, item[1]))  # the screen in view first
    return sections[:1] + [(title + (" · in view" if isinstance(screen, cls) else ""), list(cls.BINDINGS))
                           for title, cls in screens] + sections[1:]


def attached_phase(server) -> str:
    """An attached server's state as a phase: "serving", or its health's word and reason."""
    health = server.host.health
    return "serving" if health.serving else f"{health.status}: {health.reason}"


def attached_status(server, index: int, count: int) -> str:
    health, stats = server.host.health, server.host.stats()
    which = f" ({index + 1} of {count}; [ and ] switch)" if count > 1 else ""
    if health.serving:
        return f"attached to {server.url}{which}: serving {server.model_name} at {server.url}/v1"
    age = f"; the panels show its last snapshot, {time.monotonic() - server.host.fetched_at:.0f} s old" \
        if stats is not None else ""
    return f"attached to {server.url}{which}: {health.status} ({health.reason}){age}"


def title_of(screen) -> str:
    return next((title for cls, _, title in SCREENS.values() if isinstance(screen, cls)), type(screen).__name__)


if __name__ == "__main__":
    from console.cli import main

    sys.exit(main())
