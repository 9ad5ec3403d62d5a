"""EngineHost: the engine loop in its own thread, and an async stream of outputs per request.

The engine is not thread-safe, so only the host's thread touches it. Callers on an asyncio loop send commands
(add, abort) through a queue and get each request's outputs through an OutputCollector fed with
call_soon_threadsafe. A request whose consumer goes away is aborted, so its blocks return to the pool at once.

Faults stay contained: a failed step ends only the requests it carried (each hears the error), a sink that
raises ends only its own request, and the loop keeps serving; failures that repeat make /health unhealthy.
Admission is decided on the engine thread, against the queue as it is, so a burst cannot overfill it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanoserve.engine import Engine, StepFailed
from nanoserve.errors import NanoserveError, RequestFault
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.collector import OutputCollector, relay
from nanoserve.server.health import FailureLog, Health, bounded
from nanoserve.server.refusals import ADMISSION_LIMIT, Refusals
from nanoserve.stats import EngineStats
from nanoserve.tracing import TraceOrigin, current_origin

log = logging.getLogger("nanoserve.host")

_IDLE_WAIT_S = 0.05


class HostStopped(NanoserveError):
    """The host is not running (never started, shut down, or restarting)."""


class QueueFull(HostStopped):
    """The waiting queue holds max_waiting requests already; nothing was admitted."""


class EngineFailure(RuntimeError):
    """The engine failed while running this request (a bug or a device fault, not the client's input)."""


@dataclass
class _Add:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None
    sink: Callable[[RequestOutput | BaseException], None]
    user: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    streamed: bool = True
    origin: TraceOrigin | None = None  # its trace parent and API operation (tracing.py)
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    pass


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread (the engine is not thread-safe) and answer with its result."""

    fn: Callable
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def _freeze_heap() -> None:
    """Collect once, then move every object left (the loaded model, the tokenizer, torch's and the libraries'
    own) out of the cycle collector's reach. A full collection walks some 300,000 of them for about 100 ms, and
    it runs when Python decides, inside a step: a pause in every stream the engine is serving. Objects made
    while serving are collected as usual; shutdown unfreezes."""
    gc.collect()
    gc.freeze()


class EngineHost:
    """Owns one Engine and the thread that steps it."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        """`max_waiting`: requests allowed to wait for a row; one more is refused with QueueFull (a 503)."""
        self.engine: Engine | None = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sending = threading.Lock()  # a send and a stop are ordered: no command lands after the last drain
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._drain_on_stop = False
        self.failures = FailureLog()
        self.refusals = Refusals()  # counted by the HTTP layer (server/refusals.py), published with the stats
        self.load_error: str | None = None  # set when a restart left no engine at all
        self._closed: str | None = None  # why admission is closed (a graceful stop under way)
        self.admitted = self.ended = self.dropped = 0  # requests, across restarts (see accounting)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> EngineHost:
        if self._thread is not None:
            raise RuntimeError("the host is already running")
        _freeze_heap()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain: bool = False, timeout: float | None = 30.0) -> None:
        """Stop the loop: with drain, running requests finish first; otherwise they end with 'abort'."""
        if self._thread is None:
            return
        self._drain_on_stop = drain
        with self._sending:
            self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout}s")
        self._thread = None
        gc.unfreeze()  # what _freeze_heap kept: a released engine's cycles can be collected again
        self._refuse_pending()

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
        self.engine.close()  # a tensor-parallel group's other ranks go with it
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            self._load(config, progress)
        except Exception as e:
            progress(f"the new flags failed ({e}); restoring the previous flags")
            try:
                self._load(old_config, progress)
            except Exception as again:  # no engine at all: say so on every route and on /health
                self.load_error = (f"the new flags failed ({e}) and the previous flags failed too ({again}); "
                                   "restart with flags that load")
                progress(self.load_error)
                raise again from e
            raise

    def _load(self, config, progress) -> None:
        self.engine = Engine(config, progress=progress)
        self.load_error = None
        self.failures = FailureLog()
        self._stats = self.engine.stats()
        self.dropped += len(self._sinks)
        self._sinks.clear()
        self.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def serving(self) -> Engine:
        """The engine now serving, for a route to read its tokenizer and limits; HostStopped (a 503) while a
        restart has none, or after a restart left none."""
        engine = self.engine
        if engine is None or not self.running:
            raise HostStopped(self.load_error or "the engine is not running; wait for the restart to finish")
        return engine

    def health(self) -> Health:
        if self.load_error is not None:
            return Health("failed", self.load_error)
        if not self.running:
            return Health("stopped", "the engine is not running (stopped, or restarting)")
        return self.failures.health()

    def timeline(self, request_id: str) -> list[dict]:
        """A request's timelines (one per sequence) as GET /requests/{id} gives them; [] if none is kept. Read
        from the recorder directly (it is safe to read off the engine thread), so the console need not wait for
        a step to end."""
        engine = self.engine  # None while a restart builds the next one
        return [] if engine is None else engine.timelines.find(request_id, time.monotonic())

    def rows(self, match: str = "") -> list[dict]:
        """Every kept sequence whose id, status or finish reason contains `match`, as GET /requests gives them
        (the latest 1,000 finished, where the snapshot lists 100); read as `timeline` is."""
        engine = self.engine
        return [] if engine is None else engine.timelines.rows(time.monotonic(), match)

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (cheap: no engine access from this thread), with the
        requests the server refused, which never reach the engine."""
        stats = self._stats
        return dataclasses.replace(stats, features={**stats.features, "refusals": self.refusals.snapshot()})

    # ---- requests -----------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, sink: Callable, request_id: str | None = None,
               timeout: float = 60.0, user: str | None = None, cache_salt: str | None = None,
               session_id: str | None = None) -> str:
        """Queue a request from any thread; returns its id, or raises the engine's refusal (nothing held)."""
        return self.send(prompt, params, sink, request_id, user, cache_salt, session_id).result(timeout)

    def send(self, prompt, params, sink, request_id, user=None, cache_salt=None,
              session_id=None, streamed: bool = True, origin: TraceOrigin | None = None) -> concurrent.futures.Future:
        """Queue a request; the future answers with its id once the engine admitted it, or with the refusal.
        `origin` defaults to the calling route's (tracing.current_origin)."""
        cmd = _Add(prompt, params, request_id, sink, user, cache_salt, session_id, streamed,
                   origin if origin is not None else current_origin.get())
        self._enqueue(cmd, bounded=True)
        return cmd.accepted

    def _enqueue(self, cmd, bounded: bool = False) -> None:
        """Queue a command for the engine thread, or refuse it (HostStopped) while admission is closed or the
        loop is not running. Checked and queued under the lock a stop takes, so nothing lands after the last
        drain; `bounded` commands are also refused (QueueFull) once max_waiting are queued."""
        with self._sending:
            if self._closed is not None:
                raise HostStopped(self._closed)
            if not self.running or self._stop.is_set():
                raise HostStopped(self.load_error or "the engine is not running; wait for the restart to finish")
            if bounded and self.max_waiting is not None and self._commands.qsize() >= self.max_waiting:
                self.refusals.rejected_at_admission(ADMISSION_LIMIT)
                raise QueueFull(f"{self._commands.qsize()} requests are already waiting to be admitted; "
                                "retry shortly")
            self._commands.put(cmd)
        self._wake.set()

    def close_admission(self, reason: str) -> None:
        """Refuse every new request with HostStopped(reason); those already admitted run on."""
        with self._sending:
            self._closed = reason

    def live_requests(self) -> int:
        """Requests admitted (or being admitted) and not yet finished."""
        return len(self._sinks) + self._commands.qsize()

    def abort_all(self) -> None:
        """Abort every live request; each ends with finish reason "abort" (a stream with its last chunk)."""
        self._commands.put(_AbortAll())
        self._wake.set()

    async def call(self, fn: Callable):
        """`fn(engine)` run on the engine thread between steps; its result (or its exception) comes back here."""
        return await asyncio.wrap_future(self.run_on_engine(fn))

    def run_on_engine(self, fn: Callable) -> concurrent.futures.Future:
        """`call` for a caller on a plain thread: the future of `fn(engine)`, run between steps."""
        cmd = _Call(fn)
        self._enqueue(cmd)
        return cmd.done

    # ---- the operator's calls (a data-parallel front end answers the same ones across its replicas) ------
    async def reset_prefix_cache(self, who: str) -> int:
        """Forget every cached block's name; how many were named."""
        return await self.call(lambda engine: engine.reset_prefix_cache(who))

    async def knobs(self) -> dict:
        """The live flags and the log of their changes (GET /knobs)."""
        return await self.call(lambda engine: engine.knobs.as_dict())

    async def set_live(self, changes: dict, who: str) -> list:
        """Change live flags from the next step (ConfigError names what cannot change)."""
        return await self.call(lambda engine: engine.set_live(changes, who))

    async def request_rows(self, match: str = "") -> list[dict]:
        """GET /requests: read between steps, so a row is never half-updated."""
        return await self.call(lambda engine: engine.timelines.rows(time.monotonic(), match))

    async def request_timeline(self, request_id: str) -> list[dict]:
        """GET /requests/{id}: `timeline`, which needs no step to end."""
        return self.timeline(request_id)

    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        """Each engine's snapshot with its index (vLLM's `engine` label): this host's one engine is "0"."""
        return [("0", self._stats)]

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    async def open(self, prompt, params: SamplingParams, request_id: str | None = None, user: str | None = None,
                   cache_salt: str | None = None, session_id: str | None = None,
                   streamed: bool = True) -> AsyncIterator[RequestOutput]:
        """Submit now (a refusal raises here, before any response is started) and return the output stream.
        `streamed`: the client sees the tokens as they come (Engine.add_request).

        Closing the stream before its last output (a client that went away) aborts the request.
        """
        loop = asyncio.get_running_loop()
        outputs = OutputCollector()

        def sink(item):
            loop.call_soon_threadsafe(outputs.put, item)  # raises once the loop is closed: the host aborts

        # Awaiting the engine thread's answer holds no executor thread, however many clients arrive at once.
        rid = await asyncio.wrap_future(self.send(prompt, params, sink, request_id, user, cache_salt, session_id,
                                                   streamed))
        return relay(outputs, lambda: self.abort(rid))

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
                except StepFailed as e:  # the engine ended that step's requests and is sound: tell them why
                    self._step_failed(e.error, e.request_ids)
                    if engine.failed is not None:  # unless it cannot go on (a tensor-parallel rank failed)
                        self._engine_lost(engine.failed)
                        break
                    continue
                except Exception as e:  # outside a step's compute: nothing says which requests, so all end
                    log.exception("engine step failed outside its compute")
                    live = list(self._sinks)
                    self._step_failed(e, live)
                    self._fail_all(live)
                    continue
                for out in outs:
                    if out.error is not None:  # its own input failed it: the error is its last word
                        if out.finished:
                            self._deliver(out.request_id, RequestFault(out.error))
                            self._retire(out.request_id)
                        continue
                    self._deliver(out.request_id, out)
                    if out.finished:
                        self._retire(out.request_id)
                self._stats = engine.stats()
            else:
                self._stats = engine.stats()
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
        self._abort_all()
        if self.load_error is not None:  # the engine was lost: whatever was queued meanwhile hears why
            self._refuse_pending()

    def _engine_lost(self, reason: str) -> None:
        """The engine can serve no more: every live request hears why, /health says "failed" with the reason,
        and every route answers 503 until the server is restarted."""
        log.error("the engine stopped: %s", reason)
        with self._sending:  # from here every send is refused with the reason
            self.load_error = f"the engine stopped: {reason}; restart the server"
            self._stop.set()
        failure = EngineFailure(self.load_error)
        for rid in list(self._sinks):
            self._deliver(rid, failure)
            self._retire(rid)
        self._stats = self._guarded_stats()

    def _deliver(self, rid: str, item) -> None:
        """Hand one item to a request's sink; a sink that raises (its loop closed, a caller's bug) loses its
        request, which is aborted, and nothing else."""
        sink = self._sinks.get(rid)
        if sink is None:
            return
        try:
            sink(item)
        except Exception as e:  # a closed loop's RuntimeError is expected at exit: no traceback for that one
            log.error("the output sink of request %s failed (%s); aborting that request", rid, e,
                      exc_info=not isinstance(e, RuntimeError))
            self._retire(rid)
            self.engine.abort(rid)

    def _retire(self, rid: str) -> None:
        """The request has had its last word (its final output, its error, or a sink that failed)."""
        if self._sinks.pop(rid, None) is not None:
            self.ended += 1

    def accounting(self) -> dict:
        """Requests admitted, ended (each with a final output or an error), live now, and dropped (live when
        a restart replaced the engine, so never answered): admitted = ended + live + dropped, always."""
        return {"admitted": self.admitted, "ended": self.ended, "live": len(self._sinks), "dropped": self.dropped}

    def _step_failed(self, error: BaseException, request_ids: list[str]) -> None:
        self.failures.record(error)
        failure = EngineFailure(f"the engine failed while running this request ({type(error).__name__}: "
                                f"{bounded(str(error))}); other requests carry on; retry it, and report it if it "
                                f"repeats")
        for rid in request_ids:
            self._deliver(rid, failure)
            self._retire(rid)
        self._stats = self._guarded_stats()

    def _guarded_stats(self) -> EngineStats:
        try:
            return self.engine.stats()
        except Exception:
            log.exception("the engine's stats failed")
            return self._stats

    def _queued(self):
        """The commands waiting now, taken off the queue one by one."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._queued():
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
                continue
            if isinstance(cmd, _AbortAll):
                for rid in list(self._sinks):
                    self.engine.abort(rid)
                continue
            if isinstance(cmd, _Call):
                try:
                    cmd.done.set_result(cmd.fn(self.engine))
                except Exception as e:
                    cmd.done.set_exception(e)
                continue
            if self._stop.is_set():
                cmd.accepted.set_exception(HostStopped("the engine is shutting down"))
                continue
            waiting = self.engine.scheduler_stats().waiting
            if self.max_waiting is not None and waiting >= self.max_waiting:
                self.refusals.rejected_at_admission(ADMISSION_LIMIT)
                cmd.accepted.set_exception(QueueFull(f"the waiting queue is full ({waiting} requests, the limit "
                                                     f"is {self.max_waiting}); retry shortly"))
                continue
            try:
                rid = self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, user=cmd.user,
                                              cache_salt=cmd.cache_salt, session_id=cmd.session_id,
                                              streamed=cmd.streamed, trace_origin=cmd.origin)
            except Exception as e:
                cmd.accepted.set_exception(e)
                continue
            self._sinks[rid] = cmd.sink
            self.admitted += 1
            cmd.accepted.set_result(rid)

    def _refuse_pending(self) -> None:
        """After the loop has stopped: every send still queued hears that the host stopped."""
        for cmd in self._queued():
            future = cmd.accepted if isinstance(cmd, _Add) else cmd.done if isinstance(cmd, _Call) else None
            if future is not None and not future.done():
                future.set_exception(HostStopped("the engine is shutting down"))

    def _abort_all(self) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
        try:
            outs = self.engine.step()
        except Exception as e:
            self._step_failed(e, list(self._sinks))
            return
        for out in outs:  # n > 1: a request has one output per sequence, and only its last is `finished`
            self._deliver(out.request_id, out)
            if out.finished:
                self._retire(out.request_id)
        for rid in list(self._sinks):  # nothing may be left unanswered by a stop
            self._deliver(rid, HostStopped("the engine stopped before this request finished"))
            self._retire(rid)
        self._stats = self._guarded_stats()

    def _fail_all(self, request_ids: list[str]) -> None:
        """The requests named are aborted so their blocks return; the aborts' step is itself guarded."""
        for rid in request_ids:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("aborting request %s failed", rid)
        try:
            self.engine.step()
        except Exception:
            log.exception("the engine's clean-up step failed too")
