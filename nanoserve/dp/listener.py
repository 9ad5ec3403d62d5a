"""ReplicaListener: where replicas connect back to the front end, proven by the shared authkey.

Nothing a stranger does to the port may stop a replica from (re)joining: the accept loop never ends on an error
(it logs it and goes on); each accepted connection does its handshake (multiprocessing's authkey challenge, then
the replica's Hello) on its own short-lived thread, so a silent or slow caller holds only itself; a handshake not
done within HANDSHAKE_S is cut (the socket shut down under it); at most MAX_HANDSHAKES run at once. Nothing is
unpickled before the peer has proven it holds the authkey (the challenge reads at most 256 raw bytes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger("nanoserve.dp")

HANDSHAKE_S = 5.0  # a connection must prove the authkey and say Hello within this
MAX_HANDSHAKES = 64  # handshakes under way at once; one more connection is closed at once
BACKLOG = 64
ACCEPT_POLL_S = 0.5  # how often the accept loop looks whether the listener closed
LOG_EVERY_S = 10.0  # failed handshakes are logged at most this often (with a count of the rest)


class ReplicaListener:
    """Listens on (host, any free port); `on_hello(conn, hello)` gets each connection that proved the authkey,
    with the first object it sent, on that connection's handshake thread, and returns False to have it closed."""

    def __init__(self, host: str, authkey: bytes, on_hello: Callable[[Connection, object], bool],
                 handshake_s: float = HANDSHAKE_S, max_handshakes: int = MAX_HANDSHAKES):
        self._authkey, self._on_hello = authkey, on_hello
        self.handshake_s, self.max_handshakes = handshake_s, max_handshakes
        self._socket = socket.create_server((host, 0), backlog=BACKLOG)
        self._socket.settimeout(ACCEPT_POLL_S)
        self.address = (host, self._socket.getsockname()[1])
        self._lock = threading.Lock()
        self._under_way = 0
        self.joined = self.refused = 0  # handshakes that ended each way, since the start
        self._unlogged, self._logged_at = 0, -LOG_EVERY_S
        self._closed = False
        threading.Thread(target=self._accept_loop, name="nanoserve-dp-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._socket.close()

    # ---- the accept loop ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                self._accept_one()
            except Exception as e:  # whatever it was, the next replica must still get in
                if self._closed:
                    return
                self._refuse(None, f"accepting failed ({type(e).__name__}: {e})")
                time.sleep(0.1)  # out of file descriptors, say: do not spin

    def _accept_one(self) -> None:
        try:
            sock, peer = self._socket.accept()
        except TimeoutError:
            return
        try:
            self._start(sock, peer)
        except BaseException:  # a thread that could not start: this connection is lost, not the loop
            sock.close()
            raise

    def _start(self, sock: socket.socket, peer) -> None:
        with self._lock:
            full = self._under_way >= self.max_handshakes
            if not full:
                self._under_way += 1
        if full:
            sock.close()
            self._refuse(peer, f"{self.max_handshakes} handshakes already under way")
            return
        try:
            threading.Thread(target=self._handshake, args=(sock, peer), name="nanoserve-dp-handshake",
                             daemon=True).start()
        except BaseException:
            with self._lock:
                self._under_way -= 1
            raise

    # ---- one connection's handshake -------------------------------------------------------------------
    def _handshake(self, sock: socket.socket, peer) -> None:
        """Prove the authkey both ways and take the Hello within the deadline, then hand the connection on."""
        sock.setblocking(True)
        conn = Connection(os.dup(sock.fileno()))  # `sock` stays to cut the handshake short
        cut = _Deadline(sock, self.handshake_s)
        handed = False
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            hello = conn.recv()
            if not cut.stop():
                raise TimeoutError(f"no handshake within {self.handshake_s:g} s")
            handed = bool(self._on_hello(conn, hello))
            if not handed:
                raise ValueError(f"it said {type(hello).__name__}, not a replica's Hello")
            with self._lock:
                self.joined += 1
        except Exception as e:
            why = f"no handshake within {self.handshake_s:g} s" if cut.fired else f"{type(e).__name__}: {e}"
            self._refuse(peer, why)
        finally:
            cut.stop()
            sock.close()  # the handed-on connection keeps its own descriptor
            if not handed:
                conn.close()
            with self._lock:
                self._under_way -= 1

    def _refuse(self, peer, why: str) -> None:
        """Count a failed handshake and log it briefly (never the bytes sent), at most every LOG_EVERY_S."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at < LOG_EVERY_S:
                self._unlogged += 1
                return
            more, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning("replica listener: closed a connection from %s: %s%s", peer[0] if peer else "?", why[:200],
                    f" (and {more} more since the last such line)" if more else "")


class _Deadline:
    """Shuts `sock` down after `seconds` unless stopped first: a read or write blocked on it then ends at once."""

    def __init__(self, sock: socket.socket, seconds: float):
        self._sock, self._lock, self.fired, self._stopped = sock, threading.Lock(), False, False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.fired = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> bool:
        """Stop the clock; False when it had already cut the socket."""
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            return not self.fired
