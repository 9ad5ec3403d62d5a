"""DataParallelHost: EngineHost's interface over N replicas, so the routes, the guard and /health need not know
there are several.

Each request is routed (routing.py) to one ready replica, sent over its connection, and its outputs relayed to
the route's stream as they come back. A replica that dies (its connection drops: a crash, a kill, an OOM) has
its live requests ended at once with an EngineFailure (a stream gets its error event and [DONE]), is routed
around, and is started again with a growing pause between tries; it takes requests again once it says Ready.

Threads: the event loop opens and aborts requests; one reader per replica connection delivers what the replica
says; the listener (listener.py) takes replicas' connections, each handshake on its own thread; restarts run on
timers. `_lock` guards the request table.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection

from nanoserve.dp import messages as m
from nanoserve.dp.link import FrontModel, LiveRequest, ReplicaFailures, ReplicaLink
from nanoserve.dp.listener import ReplicaListener
from nanoserve.dp.live_flags import LiveFlags
from nanoserve.dp.merge import FrontLatency, merge
from nanoserve.dp.routing import ReplicaView, Router, prompt_chain
from nanoserve.errors import NanoserveError, RequestError
from nanoserve.server.collector import OutputCollector, relay
from nanoserve.server.health import Health
from nanoserve.server.host import EngineFailure, HostStopped
from nanoserve.server.refusals import Refusals
from nanoserve.stats import EngineStats
from nanoserve.tracing import current_origin

log = logging.getLogger("nanoserve.dp")

RESTART_PAUSES_S = (0.5, 1, 2, 5, 10, 30)  # before each try in a row; a replica ready for STEADY_S starts over
STEADY_S = 60.0
WATCH_S = 1.0  # how often the front end looks at replicas that are starting


class ReplicaStartFailed(NanoserveError):
    """A replica failed to load at start-up (its reason is the engine's)."""


class DataParallelHost:
    def __init__(self, launcher, size: int, routing: str = "prefix-affinity", imbalance: int = 64,
                 ready_timeout: float = 600.0, progress: Callable[[str], None] | None = None):
        """Start `size` replicas through `launcher` (launch.py) and wait until all are ready; a replica that
        fails to load stops the start with its reason (ReplicaStartFailed)."""
        self.launcher, self.size = launcher, size
        self.router = Router(routing, imbalance)
        self.refusals = Refusals()
        self.latency = FrontLatency()
        self.links = [ReplicaLink(rank, ReplicaView(rank)) for rank in range(size)]
        self.failures = ReplicaFailures(self.links)
        self.front: FrontModel | None = None
        self.admitted = self.ended = self.dropped = 0
        self._requests: dict[str, LiveRequest] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._calls = itertools.count()
        self._closed: str | None = None
        self._stopping = False
        self._started = False  # every replica was ready once: from then on a lost one is started again
        self.live_flags = LiveFlags()  # POST /knobs changes, for a restarted replica
        self._changed = threading.Condition()
        self._authkey = secrets.token_bytes(32)
        self._listener = ReplicaListener(launcher.listen_host, self._authkey, self._joined)
        self.address = self._listener.address
        progress = progress or (lambda phase: None)
        progress(f"starting {size} replicas ({launcher.backend})")
        for link in self.links:
            launcher.start(link.rank, self.address, self._authkey)
        self._wait_ready(ready_timeout, progress)

    # ---- start-up and the replicas' connections -------------------------------------------------------
    def _wait_ready(self, timeout: float, progress) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(link.status == "ready" for link in self.links):
                for link in self.links:
                    gone = self.launcher.exited(link.rank) if link.status == "starting" else None
                    if gone is not None:
                        link.status, link.reason = "failed", (
                            f"it exited before loading ({gone}; a replica is a spawned process that imports the "
                            "main script, so a script that starts a server does it under "
                            "if __name__ == '__main__')")
                failed = [link for link in self.links if link.status == "failed"]
                if failed or time.monotonic() > deadline:
                    self.shutdown()
                    why = failed[0].reason if failed else f"not ready within {timeout:.0f}s"
                    raise ReplicaStartFailed(f"replica {failed[0].rank if failed else '?'} did not start: {why}")
                self._changed.wait(0.5)
        self._started = True
        threading.Thread(target=self._watch_starting, name="nanoserve-dp-starting", daemon=True).start()
        progress("ready")

    def _watch_starting(self) -> None:
        """A replica started again that dies before it connects (killed, out of memory while loading) has no
        connection to drop: watch its process, and start it again as a dropped one is."""
        while not self._stopping:
            for link in self.links:
                if link.status != "starting" or link.conn is not None:
                    continue
                how = self.launcher.exited(link.rank)
                if how is None or link.conn is not None:
                    continue
                self.launcher.reap(link.rank, timeout=2)
                link.status, link.reason = "restarting", f"it stopped while starting ({how})"
                log.error("replica %d stopped while starting (%s)", link.rank, how)
                self._schedule_restart(link)
            time.sleep(WATCH_S)

    def _joined(self, conn: Connection, hello) -> bool:
        """A connection that proved the authkey (listener.py): a replica's, when it says Hello with its rank."""
        if not isinstance(hello, m.Hello) or not 0 <= hello.rank < self.size:
            return False
        link = self.links[hello.rank]
        link.conn, link.pid, link.node, link.actor_id = conn, hello.pid, hello.node, hello.actor_id
        threading.Thread(target=self._read, args=(link, conn), name=f"nanoserve-dp-read-{link.rank}",
                         daemon=True).start()
        return True

    def _read(self, link: ReplicaLink, conn: Connection) -> None:
        """Everything replica `link` says, until its connection drops."""
        handlers = {m.Output: self._on_output, m.Failed: self._on_failed, m.Accepted: self._on_accepted,
                    m.Refused: self._on_refused, m.Status: self._on_status, m.KVEvents: self._on_kv_events,
                    m.OpDone: self._on_op_done, m.Ready: self._on_ready, m.LoadFailed: self._on_load_failed}
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            try:
                handlers[type(message)](link, message)
            except Exception:
                log.exception("replica %d: handling %s failed", link.rank, type(message).__name__)
        self._lost(link, conn)

    def _on_ready(self, link: ReplicaLink, ready: m.Ready) -> None:
        if self.front is None:
            self.front = FrontModel(ready)
        replay = self.live_flags.replay()  # a restarted replica takes the live flags the others have,
        if replay is not None:  # queued before any request
            self._op(link, "set_live", *replay)
        with self._changed:
            link.status, link.reason, link.ready_since = "ready", None, time.monotonic()
            link.view.ready = True
            self._changed.notify_all()
        if link.restarts:
            log.warning("replica %d is back (pid %s)", link.rank, link.pid)

    def _on_load_failed(self, link: ReplicaLink, failed: m.LoadFailed) -> None:
        with self._changed:
            link.status, link.reason = "failed", f"it failed to load: {failed.reason}"
            self._changed.notify_all()

    def _lost(self, link: ReplicaLink, conn: Connection) -> None:
        """Replica `link`'s connection dropped: end its requests now, route around it, and start it again."""
        if link.conn is not conn:
            return
        link.conn = None
        with self._lock:
            link.view.ready = False
            link.view.cached.clear()
        how = self.launcher.reap(link.rank, timeout=2 if not self._stopping else 10)
        was = link.status
        if self._stopping:
            link.status = "stopped"
        elif not self._started:  # dying while loading (out of memory, say) fails the start, not a retry loop
            link.status = "failed"
            link.reason = link.reason if was == "failed" else f"it stopped while loading ({how})"
        else:
            link.status = "restarting" if was != "failed" else "failed"
            link.reason = (link.reason if was == "failed" else f"it stopped ({how})")
        error = EngineFailure(f"replica {link.rank} stopped while running this request ({how}); it is being "
                              "restarted and the others serve on; retry")
        taken = self._take_requests(link)
        for rid, live in taken:
            if not live.accepted.done():
                live.accepted.set_exception(HostStopped(f"replica {link.rank} stopped before admitting this "
                                                        "request; retry"))
            self._deliver(rid, live, error)
        for future in link.ops.values():
            if not future.done():
                future.set_exception(HostStopped(f"replica {link.rank} stopped before answering"))
        link.ops.clear()
        with self._changed:
            self._changed.notify_all()
        if not self._stopping and self._started:
            log.error("replica %d stopped (%s); %d requests on it ended with an error", link.rank, how, len(taken))
            self._schedule_restart(link)

    def _schedule_restart(self, link: ReplicaLink) -> None:
        if link.ready_since is not None and time.monotonic() - link.ready_since > STEADY_S:
            link.tries = 0
        pause = RESTART_PAUSES_S[min(link.tries, len(RESTART_PAUSES_S) - 1)]
        link.tries += 1
        link.ready_since = None

        def restart():
            if self._stopping:
                return
            link.restarts += 1
            link.status = "starting"
            try:
                self.launcher.start(link.rank, self.address, self._authkey)
            except Exception as e:
                log.exception("replica %d could not be started again", link.rank)
                link.status, link.reason = "failed", f"it could not be started again: {e}"
                self._schedule_restart(link)

        timer = threading.Timer(pause, restart)
        timer.daemon = True
        timer.start()

    # ---- what the replicas say about requests ---------------------------------------------------------
    def _on_accepted(self, link: ReplicaLink, message: m.Accepted) -> None:
        live = self._requests.get(message.request_id)
        if live is not None and not live.accepted.done():
            live.accepted.set_result(message.request_id)

    def _on_refused(self, link: ReplicaLink, message: m.Refused) -> None:
        live = self._requests.get(message.request_id)  # open() forgets it when it hears the refusal
        if live is not None and not live.accepted.done():
            live.accepted.set_exception(message.error)

    def _on_output(self, link: ReplicaLink, message: m.Output) -> None:
        live = self._requests.get(message.request_id)
        if live is None:
            return
        out = message.output
        if out.finished:
            self._retire(message.request_id, link)
            self.latency.finished(out)
            link.served += 1
        self._deliver(message.request_id, live, out)

    def _on_failed(self, link: ReplicaLink, message: m.Failed) -> None:
        live = self._requests.get(message.request_id)
        if live is not None:
            self._retire(message.request_id, link)
            self._deliver(message.request_id, live, message.error)

    def _on_status(self, link: ReplicaLink, status: m.Status) -> None:
        link.take_status(status)

    def _on_kv_events(self, link: ReplicaLink, message: m.KVEvents) -> None:
        link.view.apply(message.events)

    def _on_op_done(self, link: ReplicaLink, done: m.OpDone) -> None:
        future = link.ops.pop(done.call_id, None)
        if future is None or future.done():
            return
        if done.error is not None:
            future.set_exception(done.error)
        else:
            future.set_result(done.result)

    def _deliver(self, rid: str, live: LiveRequest, item) -> None:
        try:
            live.sink(item)
        except Exception as e:  # the route's loop closed: nobody reads this request any more
            log.error("the output sink of request %s failed (%s); aborting it", rid, e)
            self.abort(rid)

    def _retire(self, rid: str, link: ReplicaLink) -> None:
        with self._lock:  # counts change under the lock the router reads them under
            if self._requests.pop(rid, None) is None:
                return
            self.ended += 1
            link.view.in_flight -= 1

    def _take_requests(self, link: ReplicaLink) -> list[tuple[str, LiveRequest]]:
        with self._lock:
            taken = [(rid, live) for rid, live in self._requests.items() if live.link is link]
            for rid, _ in taken:
                del self._requests[rid]
            self.ended += len(taken)
            link.view.in_flight -= len(taken)
        return taken

    # ---- requests (the event loop) --------------------------------------------------------------------
    def serving(self) -> FrontModel:
        if self.front is None or not any(link.status == "ready" for link in self.links):
            raise HostStopped(self._no_replica())
        return self.front

    def _no_replica(self) -> str:
        states = ", ".join(f"replica {link.rank} {link.status}" + (f" ({link.reason})" if link.reason else "")
                           for link in self.links)
        return f"no replica is ready to serve ({states}); retry shortly"

    async def open(self, prompt, params, request_id: str | None = None, user: str | None = None,
                   cache_salt: str | None = None, session_id: str | None = None,
                   streamed: bool = True) -> AsyncIterator:
        """Route, submit (a refusal raises here, before any response starts) and return the output stream."""
        front = self.serving()
        if self._closed is not None:
            raise HostStopped(self._closed)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        chain = []
        if front.ready.prefix_caching and self.router.policy == "prefix-affinity":
            ids = front.prompt_ids(prompt)
            chain = prompt_chain(ids, front.ready.block_size, front.ready.cache_root, cache_salt)
        loop = asyncio.get_running_loop()
        outputs = OutputCollector()
        sink = lambda item: loop.call_soon_threadsafe(outputs.put, item)  # noqa: E731
        with self._lock:
            if rid in self._requests:
                raise RequestError(f"request id {rid!r} is already in use; pick a unique id")
            view = self.router.pick([link.view for link in self.links], chain)
            if view is None:
                raise HostStopped(self._no_replica())
            link = self.links[view.rank]
            live = self._requests[rid] = LiveRequest(link, sink)
            view.in_flight += 1
            self.admitted += 1
        try:
            link.send(m.Add(rid, prompt, params, user, cache_salt, session_id, streamed, current_origin.get()))
            await asyncio.wrap_future(live.accepted)
        except BaseException:
            self._forget(rid, link)
            raise
        return relay(outputs, lambda: self.abort(rid))

    def _forget(self, rid: str, link: ReplicaLink) -> None:
        """A request refused or never sent: it was not admitted after all."""
        with self._lock:
            if self._requests.pop(rid, None) is None:
                return
            self.admitted -= 1
            link.view.in_flight -= 1

    def abort(self, request_id: str) -> None:
        live = self._requests.get(request_id)
        if live is not None:
            try:
                live.link.send(m.Abort(request_id))
            except HostStopped:
                pass  # the replica is gone, and its requests with it

    def abort_all(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)

    def close_admission(self, reason: str) -> None:
        self._closed = reason

    def live_requests(self) -> int:
        return len(self._requests)

    def accounting(self) -> dict:
        return {"admitted": self.admitted, "ended": self.ended, "live": len(self._requests),
                "dropped": self.dropped}

    # ---- the operator's calls, across the replicas ----------------------------------------------------
    def _op(self, link: ReplicaLink, name: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._calls)
        link.ops[call_id] = future
        try:
            link.send(m.Op(call_id, name, args))
        except HostStopped as e:
            link.ops.pop(call_id, None)
            future.set_exception(e)
        return future

    async def _all(self, name: str, *args) -> list[tuple[int, object]]:
        """(rank, answer) from every ready replica; HostStopped when none is."""
        ready = [link for link in self.links if link.status == "ready"]
        if not ready:
            raise HostStopped(self._no_replica())
        answers = await asyncio.gather(*(asyncio.wrap_future(self._op(link, name, *args)) for link in ready))
        return [(link.rank, answer) for link, answer in zip(ready, answers)]

    async def reset_prefix_cache(self, who: str) -> int:
        return sum(n for _, n in await self._all("reset_prefix_cache", who))

    async def knobs(self) -> dict:
        return (await self._all("knobs"))[0][1]

    async def set_live(self, changes: dict, who: str) -> list:
        """Every ready replica takes the same changes, and a replica started again later takes them too."""
        done = (await self._all("set_live", changes, who))[0][1]
        self.live_flags.add(changes, who)
        return done

    async def request_rows(self, match: str = "") -> list[dict]:
        return [{**row, "replica": rank} for rank, rows in await self._all("rows", match) for row in rows]

    async def request_timeline(self, request_id: str) -> list[dict]:
        return [{**seq, "replica": rank} for rank, seqs in await self._all("timeline", request_id) for seq in seqs]

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._stopping and any(link.status == "ready" for link in self.links)

    @property
    def engine(self):
        return None  # the engines are the replicas' own, in other processes

    def health(self) -> Health:
        if self._stopping:
            return Health("stopped", "the server is stopping")
        ready = [link for link in self.links if link.status == "ready"]
        if not ready:
            status = "failed" if all(link.status == "failed" for link in self.links) else "stopped"
            return Health(status, self._no_replica())
        sick = [link for link in ready if link.health is not None and not link.health.ok]
        if len(sick) == len(ready):
            return Health("unhealthy", "; ".join(f"replica {link.rank}: {link.health.reason}" for link in sick),
                          "; ".join(f"replica {link.rank}: {link.health.detail}" for link in sick
                                    if link.health.detail) or None)
        down = [link for link in self.links if link not in ready or link in sick]
        if down:
            return Health("ok", f"{len(ready) - len(sick)} of {self.size} replicas serving; " + ", ".join(
                f"replica {link.rank} {link.status}" + (f" ({link.reason})" if link.reason else "")
                for link in down))
        return Health("ok")

    def data_parallel(self) -> dict:
        return {"size": self.size, "backend": self.launcher.backend, "routing": self.router.policy,
                "replicas_ready": sum(link.status == "ready" for link in self.links),
                "replicas": [link.describe() for link in self.links]}

    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        return [(str(link.rank), link.stats) for link in self.links if link.status == "ready" and link.stats]

    def stats(self) -> EngineStats:
        known = [(link.rank, link.stats) for link in self.links if link.stats is not None]
        if not known:
            raise HostStopped(self._no_replica())
        merged = merge(known, self.latency, self.data_parallel())
        merged.features["refusals"] = self.refusals.snapshot()
        return merged

    # ---- stopping -------------------------------------------------------------------------------------
    def shutdown(self, drain: bool = False, timeout: float | None = 30.0) -> None:
        """Stop every replica (with drain, running requests finish first) and end what is left."""
        if self._stopping:
            return
        self._stopping = True
        for link in self.links:
            try:
                link.send(m.Stop(drain))
            except HostStopped:
                pass
        deadline = time.monotonic() + (timeout or 30.0)
        with self._changed:
            while any(link.conn is not None for link in self.links) and time.monotonic() < deadline:
                self._changed.wait(0.2)
        self.launcher.stop_all(5.0)
        self._listener.close()
        stopped = HostStopped("the engine stopped before this request finished")
        for link in self.links:
            for rid, live in self._take_requests(link):
                self._deliver(rid, live, stopped)
