"""`nanoserve serve`: load the engine, start its host, and serve the OpenAI API with uvicorn."""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.server.app import build_app
from nanoserve.server.host import EngineHost

log = logging.getLogger("nanoserve.serve")


class Server:
    """An engine host plus a uvicorn server; usable in the foreground (run) or from a thread (start/stop)."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, served_model_name: str | None = None, max_waiting: int = 256,
                 progress=None, trust_request_chat_template: bool = False):
        """`progress` (a callable taking a phase name) hears the engine's start-up phases."""
        engine = Engine(config, progress=progress)
        self.host = EngineHost(engine).start()
        self.model_name = served_model_name or engine.loaded.name
        self.app = build_app(self.host, self.model_name, api_key=api_key, max_waiting=max_waiting,
                             trust_request_chat_template=trust_request_chat_template)
        if port == 0:
            port = _free_port(host)
        self.address = (host, port)
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> Engine:
        """The engine serving now (a restart replaces it)."""
        return self.host.engine

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def run(self) -> None:
        print(f"nanoserve: serving {self.model_name} at {self.url}/v1 (Ctrl-C to stop)", flush=True)
        try:
            self.uvicorn.run()
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
            pass
        finally:
            self.host.shutdown(drain=False)
        print("nanoserve: stopped", flush=True)

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.uvicorn.run, name="nanoserve-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server failed to start on {self.url}")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.host.shutdown(drain=False)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
