"""EngineHost: the engine loop in its own thread, and an async stream of outputs per request.

The engine is not thread-safe, so only the host's thread touches it. Callers on an asyncio loop send commands
(add, abort) through a queue and get each request's outputs through an asyncio.Queue fed with
call_soon_threadsafe. A request whose consumer goes away is aborted, so its blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanoserve.engine import Engine
from nanoserve.errors import NanoserveError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.stats import EngineStats

log = logging.getLogger("nanoserve.host")

_IDLE_WAIT_S = 0.05


class HostStopped(NanoserveError):
    """The host is not running (never started, shut down, or restarting)."""


@dataclass
class _Add:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None
    sink: Callable[[RequestOutput | BaseException], None]
    user: str | None = None
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


class EngineHost:
    """Owns one Engine and the thread that steps it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._drain_on_stop = False

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> EngineHost:
        if self._thread is not None:
            raise RuntimeError("the host is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = False, timeout: float | None = 30.0) -> None:
        """Stop the loop: with drain, running requests finish first; otherwise they end with 'abort'."""
        if self._thread is None:
            return
        self._drain_on_stop = drain
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout}s")
        self._thread = None

    def restart(self, config, drain: bool = False, timeout: float | None = 120.0,
                progress: Callable[[str], None] | None = None) -> None:
        """Replace the engine with one built from `config` (new flags), then resume serving.

        The old engine is released before the new one loads, so a GPU never holds two KV pools. Requests that
        arrive meanwhile are refused with HostStopped (a 503). If the new flags fail to load, the old
        configuration is loaded again and the error is raised. `progress` hears each phase as it starts.
        """
        import gc

        import torch

        progress = progress or (lambda phase: None)
        progress("draining running requests" if drain else "stopping the engine")
        self.shutdown(drain=drain, timeout=timeout)
        old_config = self.engine.config
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            self.engine = Engine(config, progress=progress)
        except Exception as e:
            progress(f"the new flags failed ({e}); restoring the previous flags")
            self.engine = Engine(old_config, progress=progress)
            raise
        finally:
            self._stats = self.engine.stats()
            self._commands = queue.SimpleQueue()
            self._sinks.clear()
            self.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (cheap: no engine access from this thread)."""
        return self._stats

    # ---- requests -----------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, sink: Callable, request_id: str | None = None,
               timeout: float = 60.0, user: str | None = None) -> str:
        """Queue a request from any thread; returns its id, or raises the engine's refusal (nothing held)."""
        return self._send(prompt, params, sink, request_id, user).result(timeout)

    def _send(self, prompt, params, sink, request_id, user=None) -> concurrent.futures.Future:
        if not self.running or self._stop.is_set():
            raise HostStopped("the engine is not running; wait for the restart to finish")
        cmd = _Add(prompt, params, request_id, sink, user)
        self._commands.put(cmd)
        self._wake.set()
        return cmd.accepted

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    async def open(self, prompt, params: SamplingParams, request_id: str | None = None, user: str | None = None
                   ) -> AsyncIterator[RequestOutput]:
        """Submit now (a refusal raises here, before any response is started) and return the output stream.

        Closing the stream before its last output (a client that went away) aborts the request.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(item):
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        # Awaiting the engine thread's answer holds no executor thread, however many clients arrive at once.
        rid = await asyncio.wrap_future(self._send(prompt, params, sink, request_id, user))
        return self._stream(rid, outputs)

    async def _stream(self, rid: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """`open` and iterate in one: async stream of one request's outputs."""
        stream = await self.open(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    # ---- the loop (host thread only) ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._apply_commands()
            if self._stop.is_set() and not (self._drain_on_stop and engine.has_unfinished()):
                break
            if engine.has_unfinished():
                try:
                    outs = engine.step()
                except Exception as e:  # a bug, not a client's input: fail every live request, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                for out in outs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                self._stats = engine.stats()
            else:
                self._stats = engine.stats()
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
        self._abort_all()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
                continue
            if self._stop.is_set():
                cmd.accepted.set_exception(HostStopped("the engine is shutting down"))
                continue
            try:
                rid = self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, user=cmd.user)
            except Exception as e:
                cmd.accepted.set_exception(e)
                continue
            self._sinks[rid] = cmd.sink
            cmd.accepted.set_result(rid)

    def _abort_all(self) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
        for out in self.engine.step():
            sink = self._sinks.pop(out.request_id, None)
            if sink is not None:
                sink(out)
        self._stats = self.engine.stats()

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink(RuntimeError(f"the engine failed while running this request: {error}"))
        self._sinks.clear()
        self.engine.step()
