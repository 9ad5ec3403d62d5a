"""A data-parallel replica: one Engine in its own EngineHost, answering the front end over one connection.

The same code runs in a spawned process (the mp backend) and inside a Ray actor (the ray backend): either way
the replica connects back to the front end's listener, says Hello, loads, says Ready, then serves until told to
Stop or until the connection drops (the front end went away), when it stops its engine and returns.

Three threads talk to the connection: this one reads; the engine thread sends each output (and the step's KV
events) as the sink hears it; a status thread sends the snapshot every STATUS_EVERY_S (its finished rows only when they changed). Sends
share one lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import Client, Connection

from nanoserve.dp import messages as m

log = logging.getLogger("nanoserve.dp.replica")
_UNSENT = object()
CONNECT_S = 120.0  # how long a replica keeps trying to reach the front end's listener


def spawned(address, authkey: bytes, rank: int, config, threads: int, max_waiting: int | None) -> None:
    """A spawned process's entry point (launch.ProcessLauncher). Ctrl-C in a terminal reaches the whole process
    group, and systemd's stop every process of the unit: the replica leaves both to the front end, which stops it
    in order (and a replica whose front end is gone stops when its connection drops)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s replica {rank} %(name)s: %(message)s")
    if threads:
        import torch

        torch.set_num_threads(threads)
    Replica(connect(address, authkey), rank).serve(config, max_waiting)


def connect(address, authkey: bytes, within_s: float = CONNECT_S) -> Connection:
    """The connection to the front end's listener, tried again (with a growing pause) while it is refused or cut:
    a listener busy with strangers' handshakes closes a connection over its limit, and the replica comes back
    later instead of dying unheard."""
    deadline, pause = time.monotonic() + within_s, 0.1
    while True:
        try:
            return Client(address, authkey=authkey)
        except (OSError, EOFError) as e:
            if time.monotonic() + pause > deadline:
                raise ConnectionError(f"the front end's listener at {address} refused this replica for "
                                      f"{within_s:g} s ({type(e).__name__}: {e})") from None
            time.sleep(pause)
            pause = min(2 * pause, 2.0)


class Replica:
    def __init__(self, conn: Connection, rank: int, actor_id: str | None = None):
        self.conn, self.rank, self.actor_id = conn, rank, actor_id
        self._sending = threading.Lock()
        self._gone = threading.Event()  # the front end is unreachable, or asked us to stop
        self.host = None
        self._newest_sent = _UNSENT  # the newest finished row the last Status carried

    def send(self, message) -> None:
        with self._sending:
            try:
                self.conn.send(message)
            except (OSError, EOFError, ValueError):  # the front end is gone: stop serving
                self._gone.set()
                raise

    def serve(self, config, max_waiting: int | None = None) -> None:
        from nanoserve.engine import Engine
        from nanoserve.server.host import EngineHost

        self.send(m.Hello(self.rank, os.getpid(), socket.gethostname(), self.actor_id))
        if config.device.startswith("cuda:"):  # its own GPU is the current one: kernels and graphs launch there
            import torch

            torch.cuda.set_device(config.device)
        try:
            engine = Engine(dataclasses.replace(config, data_parallel_rank=self.rank))
        except BaseException as e:  # said to the front end, which decides whether to try again
            self.send(m.LoadFailed(f"{type(e).__name__}: {e}"))
            return
        engine.add_kv_event_listener(self._kv_events)
        self.host = EngineHost(engine, max_waiting=max_waiting).start()
        kv = engine.kv
        self.send(m.Ready(engine.runner.loaded.name, engine.tokenizer, engine.model_config, engine.max_model_len,
                          kv.block_size, kv.cache_root, kv.prefix_caching))
        self._send_quietly(self._status())  # the front end has a snapshot from the moment it routes here
        status = threading.Thread(target=self._report, name="nanoserve-replica-status", daemon=True)
        status.start()
        drain = self._read()
        self._gone.set()
        self.host.shutdown(drain=drain)
        engine.close()
        self.conn.close()

    # ---- the connection's reader ----------------------------------------------------------------------
    def _read(self) -> bool:
        """Answer the front end until Stop (returns its drain) or a dropped connection (False)."""
        while not self._gone.is_set():
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return False
            if isinstance(message, m.Stop):
                return message.drain
            try:
                self._handle(message)
            except (OSError, EOFError):
                return False
        return False

    def _handle(self, message) -> None:
        if isinstance(message, m.Add):
            self._add(message)
        elif isinstance(message, m.Abort):
            self.host.abort(message.request_id)
        elif isinstance(message, m.Op):
            self._op(message)
        else:
            log.error("unknown message from the front end: %r", type(message).__name__)

    def _add(self, add: m.Add) -> None:
        rid = add.request_id

        def sink(item):  # on the engine thread
            self.send(m.Failed(rid, m.portable(item)) if isinstance(item, BaseException) else m.Output(rid, item))

        def admitted(future):
            error = future.exception()
            self._send_quietly(m.Refused(rid, m.portable(error)) if error is not None else m.Accepted(rid))

        try:
            future = self.host.send(add.prompt, add.params, sink, rid, add.user, add.cache_salt, add.session_id,
                                    add.streamed, add.origin)
        except Exception as e:  # refused at once (admission closed, the queue full)
            self._send_quietly(m.Refused(rid, m.portable(e)))
            return
        future.add_done_callback(admitted)

    def _op(self, op: m.Op) -> None:
        """Run an operator's call; engine calls wait for the step between (EngineHost.run_on_engine)."""
        host = self.host
        calls = {
            "reset_prefix_cache": lambda who: host.run_on_engine(lambda e: e.reset_prefix_cache(who)),
            "knobs": lambda: host.run_on_engine(lambda e: e.knobs.as_dict()),
            "set_live": lambda changes, who: host.run_on_engine(lambda e: e.set_live(changes, who)),
            "rows": lambda match: _done(host.rows(match)),
            "timeline": lambda request_id: _done(host.timeline(request_id)),
        }
        try:
            future = calls[op.name](*op.args)
        except Exception as e:
            self._send_quietly(m.OpDone(op.call_id, error=m.portable(e)))
            return

        def answered(f):
            error = f.exception()
            self._send_quietly(m.OpDone(op.call_id, None if error else f.result(),
                                        m.portable(error) if error else None))

        future.add_done_callback(answered)

    # ---- what the replica reports ---------------------------------------------------------------------
    def _kv_events(self, events: list) -> None:
        self._send_quietly(m.KVEvents(list(events)))

    def _report(self) -> None:
        while not self._gone.wait(m.STATUS_EVERY_S):
            self._send_quietly(self._status())

    def _status(self) -> m.Status:
        """The snapshot, with the finished rows only when one was added since the last (rows are built once, at
        a request's finish, and only ever added newest first: the newest one's identity tells)."""
        host = self.host
        stats = host.stats()
        newest = stats.finished_rows[0] if stats.finished_rows else None
        changed = self._newest_sent is _UNSENT or newest is not self._newest_sent
        self._newest_sent = newest
        return m.Status(dataclasses.replace(stats, finished_rows=()), host.health(), host.failures.total,
                        stats.finished_rows if changed else None)

    def _send_quietly(self, message) -> None:
        """Send from a thread that can do nothing about a front end that went away (the reader notices)."""
        try:
            self.send(message)
        except (OSError, EOFError, ValueError):
            pass


def _done(value):
    import concurrent.futures

    future = concurrent.futures.Future()
    future.set_result(value)
    return future


class RayReplica:
    """The ray backend's actor (launch.RayLauncher wraps it with ray.remote): `serve` runs a Replica until the
    front end stops it, on the actor's own process, placed and resourced by Ray."""

    def serve(self, address, authkey: bytes, rank: int, config, threads: int, max_waiting: int | None) -> None:
        import ray

        if threads:
            import torch

            torch.set_num_threads(threads)
        actor_id = ray.get_runtime_context().get_actor_id()
        Replica(connect(address, authkey), rank, actor_id).serve(config, max_waiting)
