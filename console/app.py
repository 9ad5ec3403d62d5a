"""nanoserve-console: the operator's terminal app, an engine and its OpenAI server with screens to watch and steer."""

from __future__ import annotations

import argparse
import sys
import threading
import time

from textual.app import App, SystemCommand
from textual.binding import Binding

from console.logs import EngineLog
from console.screens.ab import ABScreen
from console.screens.chat import ChatScreen
from console.screens.dashboard import Dashboard
from console.screens.flags import FlagsScreen
from console.screens.help import HelpScreen
from console.screens.load import LoadScreen
from console.screens.log import LogScreen
from nanoserve.config import EngineConfig

# mode name -> (screen, key, title); every mode is a footer binding and a command-palette entry
SCREENS = {
    "dashboard": (Dashboard, "d", "Dashboard"),
    "flags": (FlagsScreen, "f", "Flags"),
    "load": (LoadScreen, "l", "Load"),
    "chat": (ChatScreen, "c", "Chat"),
    "ab": (ABScreen, "a", "A/B"),
    "log": (LogScreen, "e", "Engine log"),
}


class NanoserveConsole(App):
    """Starts a `Server` (engine host + OpenAI API on loopback) in a thread worker; screens watch and steer it.

    State the screens read: `server` (None until loaded), `config` (the flags in force), `phase` (what the
    engine is doing: loading, serving, restarting...), `load_error`, `restart_error`.
    """

    TITLE = "nanoserve console"
    CSS_PATH = "console.tcss"
    MODES = {name: screen for name, (screen, _, _) in SCREENS.items()}
    DEFAULT_MODE = "dashboard"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        *(Binding(key, f"switch_mode('{name}')", title, id=f"screen_{name}") for name, (_, key, title) in SCREENS.items()),
    ]

    def __init__(self, config: EngineConfig, port: int = 0, refresh_s: float = 1.0, attach=None):
        """`attach`: a running Server to watch instead of starting one (it outlives the app)."""
        super().__init__()
        self.config = config
        self.attached = attach
        self.port = port
        self.refresh_s = refresh_s
        self.server = None  # a nanoserve.server.serve.Server once loaded
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

    def on_mount(self) -> None:
        self.engine_log.attach()
        self.run_worker(self._start_server, thread=True, name="server", exit_on_error=False)

    # ---- engine lifecycle (worker threads) ----------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """Called from any thread; screens read it on their next tick."""
        self.phase, self.phase_since = phase, time.monotonic()
        self.phases.append((self.phase_since, phase))
        self.engine_log.note(f"engine: {phase}")

    def _start_server(self) -> None:
        try:
            self._load()
        finally:
            self.load_done.set()

    def _load(self) -> None:
        from nanoserve.server.serve import Server

        try:
            server = self.attached or Server(self.config, port=self.port, progress=self.set_phase).start()
        except Exception as e:  # shown on every screen's status line
            self.load_error = e
            self.set_phase(f"failed to load: {e}")
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self.server = server
                self.set_phase("serving")
        if closing and server is not self.attached:  # the app quit while the model loaded
            server.stop()

    @property
    def restarting(self) -> bool:
        return any(w.name == "restart" and not w.is_finished for w in self.workers)

    def restart_engine(self, config: EngineConfig, drain: bool = False) -> None:
        """Swap the engine for one built with `config` in a worker; the server and its port stay up."""
        if self.server is None or self.restarting:
            raise RuntimeError("the engine is not serving yet; wait for it before restarting")
        self.restart_error = None
        self.run_worker(lambda: self._restart(config, drain), thread=True, name="restart", exit_on_error=False)

    def _restart(self, config: EngineConfig, drain: bool) -> None:
        try:
            self.server.host.restart(config, drain=drain, progress=self.set_phase)
            self.config = config
            self.set_phase("serving")
        except Exception as e:
            self.restart_error = e
            self.set_phase(f"serving the previous flags: the restart failed ({e})")
        finally:
            self.restarts += 1

    def status_line(self) -> str:
        server, phase = self.server, self.phase
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
        if server is not None and server is not self.attached:
            await asyncio.to_thread(server.stop)
        self.engine_log.detach()

    # ---- actions ------------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(list(self.BINDINGS) + list(self.screen.BINDINGS)))

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


def title_of(screen) -> str:
    return next((title for cls, _, title in SCREENS.values() if isinstance(screen, cls)), type(screen).__name__)


def main(argv: list[str] | None = None) -> int:
    from nanoserve.flags import add_engine_flags, engine_flags

    parser = argparse.ArgumentParser(prog="nanoserve-console", description=__doc__)
    add_engine_flags(parser)
    parser.add_argument("--port", type=int, default=0, help="OpenAI server port on 127.0.0.1 (0: a free port)")
    parser.add_argument("--refresh", type=float, default=1.0,
                        help="refresh interval, seconds (+/- on the dashboard change it while running)")
    parser.add_argument("--once", action="store_true",
                        help="print the dashboard once as text (two snapshots --refresh apart) and exit")
    parser.add_argument("--keymap", action="append", default=[], metavar="ID=KEYS",
                        help="rebind a key by its binding id, e.g. --keymap quit=ctrl+q (repeatable; ids in ?)")
    args = parser.parse_args(argv)
    try:
        keymap = dict(item.split("=", 1) for item in args.keymap)
    except ValueError:
        parser.error(f"--keymap takes ID=KEYS, got {args.keymap}")
    config = EngineConfig.from_flags(**engine_flags(args))
    if args.once:
        return print_once(config, args.port, args.refresh)
    app = NanoserveConsole(config, port=args.port, refresh_s=args.refresh)
    app.set_keymap(keymap)
    app.run()
    if app.load_error is not None:  # the screen is gone: the reason stays in the terminal, and scripts see it
        print(f"nanoserve-console: the engine did not load: {app.load_error}", file=sys.stderr)
        return 1
    return 0


def print_once(config: EngineConfig, port: int, refresh_s: float) -> int:
    """--once: load, print the dashboard's text, stop. A model that does not load is exit 1, with why."""
    from console.snapshot import once
    from nanoserve.server.serve import Server

    try:
        server = Server(config, port=port).start()
    except Exception as e:
        print(f"nanoserve-console: the engine did not load: {e}", file=sys.stderr)
        return 1
    try:
        sys.stdout.write(once(server, refresh_s))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
