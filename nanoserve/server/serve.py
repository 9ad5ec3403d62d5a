"""`nanoserve serve`: load the engine, start its host, and serve the OpenAI API with uvicorn."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from dataclasses import dataclass

import uvicorn

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import ConfigError
from nanoserve.server.access import is_loopback
from nanoserve.server.app import build_app
from nanoserve.server.guard import BODY_TIMEOUT_S
from nanoserve.server.host import EngineHost
from nanoserve.server.http import GracefulServer, header_timeout_protocol

log = logging.getLogger("nanoserve.serve")


class Server:
    """An engine host plus a uvicorn server; usable in the foreground (run) or from a thread (start/stop)."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, served_model_name: str | None = None, max_waiting: int = 256,
                 progress=None, trust_request_chat_template: bool = False, shutdown_timeout: float = 10.0,
                 tool_call_parser: str | None = None,
                 limit_concurrency: int | None = 1000, header_timeout: float = 15.0,
                 prompt_tokens_details: bool = False, data_parallel: DataParallel | None = None,
                 body_timeout: float = BODY_TIMEOUT_S, force_include_usage: bool = False,
                 return_tokens_as_token_ids: bool = False, per_request_metrics: bool = False):
        """`progress` (a callable taking a phase name) hears the engine's start-up phases.

        On a stop, requests in flight get `shutdown_timeout` seconds to finish before they are aborted.
        `limit_concurrency` connections (uvicorn's limit: one more is answered 503), `header_timeout` seconds
        for a request's headers and `body_timeout` for its whole body bound what clients that never finish can
        hold.

        The listening socket is bound first, before the model loads: a port already in use is refused at once
        with the fix, not after a load and a "serving" line (and uvicorn serves on this very socket, so nothing
        can take the port in between). Port 0 binds a free one."""
        self.socket = bind_listener(host, port)
        if api_key is None and not is_loopback(host):
            log.warning("serving on %s without --api-key: every route is open to whoever reaches the port, the "
                        "stats snapshot on /health (requests, users, flags) included", host)
        try:
            self.host, loaded_name = _start_host(config, max_waiting, data_parallel, progress)
        except BaseException:
            self.socket.close()
            raise
        self.model_name = served_model_name or loaded_name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # what a client here sends
        self.app = build_app(self.host, self.model_name, api_key=api_key,
                             trust_request_chat_template=trust_request_chat_template,
                             tool_call_parser=tool_call_parser, prompt_tokens_details=prompt_tokens_details,
                             body_timeout=body_timeout, force_include_usage=force_include_usage,
                             return_tokens_as_token_ids=return_tokens_as_token_ids,
                             per_request_metrics=per_request_metrics)
        self.address = (host, self.socket.getsockname()[1])
        config = uvicorn.Config(self.app, host=host, port=self.address[1], log_level="warning",
                                http=header_timeout_protocol(header_timeout), limit_concurrency=limit_concurrency,
                                timeout_graceful_shutdown=5)
        self.uvicorn = GracefulServer(config, self.host, shutdown_timeout)
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> Engine:
        """The engine serving now (a restart replaces it)."""
        return self.host.engine

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def run(self) -> None:
        """Serve in the foreground until SIGINT or SIGTERM, then stop gracefully and return (exit status 0)."""
        print(f"nanoserve: serving {self.model_name} at {self.url}/v1 (Ctrl-C to stop)", flush=True)
        # uvicorn raises the signals it handled again once it has shut down; SIGTERM's default action would
        # then kill the process (status 143) after a clean stop, so it is made harmless for that moment
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            self.uvicorn.run(sockets=[self.socket])
        except KeyboardInterrupt:  # the re-raised Ctrl-C
            pass
        finally:
            self.host.shutdown(drain=False)
            if self.host.engine is not None:
                self.host.engine.close()
            signal.signal(signal.SIGTERM, previous)
        print("nanoserve: stopped", flush=True)

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="nanoserve-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server failed to start on {self.url}")
            self._thread.join(0.02)
        return self

    def stop(self, shutdown_timeout: float = 0.0) -> None:
        """Stop from another thread (the console, tests): running requests get `shutdown_timeout` seconds, then
        are aborted, their streams ended properly (a signal in the foreground gives --shutdown-timeout)."""
        self.uvicorn.shutdown_timeout = shutdown_timeout
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.host.shutdown(drain=False)
        if self.host.engine is not None:
            self.host.engine.close()


@dataclass(frozen=True)
class DataParallel:
    """`--data-parallel-size` and how its replicas run (dp/)."""

    size: int = 1
    backend: str = "mp"
    ray_address: str | None = None
    routing: str = "prefix-affinity"


def _start_host(config: EngineConfig, max_waiting: int, data_parallel: DataParallel | None, progress):
    """The host serving the routes, and the loaded model's name: one engine here, or the replicas' front end."""
    if data_parallel is None or data_parallel.size == 1:
        engine = Engine(config, progress=progress)
        return EngineHost(engine, max_waiting=max_waiting).start(), engine.runner.loaded.name
    from nanoserve.dp.front import DataParallelHost
    from nanoserve.dp.launch import launcher

    dp = data_parallel
    if dp.size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {dp.size}")
    if config.tensor_parallel_size > 1:
        raise ConfigError("--data-parallel-size with --tensor-parallel-size is not supported yet; run replicas "
                          "of one device each, or one tensor-parallel engine")
    start = launcher(dp.backend, config, dp.size, max_waiting, dp.ray_address)
    host = DataParallelHost(start, dp.size, dp.routing, imbalance=config.max_num_seqs, progress=progress)
    return host, host.front.name


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one, or a ConfigError naming the port and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?); stop that one or "
                              "choose another port with --port N (--port 0 picks a free one)") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; check --host and --port") from None
    sock.set_inheritable(True)
    sock.listen(2048)  # connecting from the moment "serving" is printed: queued until uvicorn accepts, not refused
    return sock
