"""nanoserve-console: the operator's terminal app, an engine and its OpenAI server with a live dashboard."""

from __future__ import annotations

import argparse
import sys
import threading

from textual.app import App
from textual.binding import Binding

from console.dashboard import Dashboard
from console.help import HelpScreen
from nanoserve.config import EngineConfig


class NanoserveConsole(App):
    """Starts a `Server` (engine host + OpenAI API on loopback) in a thread worker and watches its snapshots."""

    TITLE = "nanoserve console"
    CSS_PATH = "console.tcss"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
    ]

    def __init__(self, config: EngineConfig, port: int = 0, refresh_s: float = 0.5):
        super().__init__()
        self.config = config
        self.port = port
        self.refresh_s = refresh_s
        self.server = None  # a nanoserve.server.serve.Server once loaded
        self.load_error: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()  # orders "the server is up" against "the app is closing"
        self.load_done = threading.Event()  # set when the load thread has ended, whatever its outcome

    def on_mount(self) -> None:
        self.push_screen(Dashboard(self.refresh_s))
        self.run_worker(self._start_server, thread=True, name="server", exit_on_error=False)

    def _start_server(self) -> None:
        try:
            self._load()
        finally:
            self.load_done.set()

    def _load(self) -> None:
        from nanoserve.server.serve import Server

        try:
            server = Server(self.config, port=self.port).start()
        except Exception as e:  # shown on the dashboard's status line
            self.load_error = e
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self.server = server
        if closing:  # the app quit while the model loaded
            server.stop()

    async def on_unmount(self) -> None:
        import asyncio

        with self._lock:
            self._closing = True
            server, self.server = self.server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(list(self.BINDINGS) + list(Dashboard.BINDINGS)))


def main(argv: list[str] | None = None) -> int:
    from nanoserve.cli import add_engine_flags, engine_flags

    parser = argparse.ArgumentParser(prog="nanoserve-console", description=__doc__)
    add_engine_flags(parser)
    parser.add_argument("--port", type=int, default=0, help="OpenAI server port on 127.0.0.1 (0: a free port)")
    parser.add_argument("--refresh", type=float, default=0.5, help="dashboard refresh interval, seconds")
    args = parser.parse_args(argv)
    config = EngineConfig.from_flags(**engine_flags(args))
    NanoserveConsole(config, port=args.port, refresh_s=args.refresh).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
