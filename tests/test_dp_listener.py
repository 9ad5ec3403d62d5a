"""The data-parallel front end's replica listener against strangers on its port: a wrong authkey, garbage bytes,
a connection that proves the key but says something other than Hello, a silent connection held open, more
connections than it handshakes at once. None of them stops a replica from joining; a silent one is cut at the
handshake deadline."""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import AuthenticationError, Client

import pytest

from nanoserve.dp import messages as m
from nanoserve.dp.listener import ReplicaListener
from tests.helpers import wait_until

KEY = os.urandom(32)


class Front:
    """The front end's side: takes a replica's Hello, as DataParallelHost._joined does."""

    def __init__(self):
        self.hellos: list[m.Hello] = []
        self.conns = []

    def joined(self, conn, hello) -> bool:
        if not isinstance(hello, m.Hello):
            return False
        self.hellos.append(hello)
        self.conns.append(conn)
        return True


@pytest.fixture
def front():
    front = Front()
    yield front
    for conn in front.conns:
        conn.close()


def _join(address, rank: int) -> None:
    """What a replica does first (replica.py): connect with the key, say Hello."""
    conn = Client(address, authkey=KEY)
    conn.send(m.Hello(rank, os.getpid(), "here", None))
    conn.close()


def _silent(address) -> socket.socket:
    return socket.create_connection(address, timeout=30)


def test_bad_handshakes_leave_the_listener_taking_replicas(front):
    listener = ReplicaListener("127.0.0.1", KEY, front.joined, handshake_s=60)
    held = _silent(listener.address)  # says nothing, for longer than the rest of the test
    outcome: dict = {}

    def strangers_then_a_replica():  # on a thread: a listener that hangs fails the wait below, not the run
        with pytest.raises(AuthenticationError):
            Client(listener.address, authkey=b"not the key")
        with socket.create_connection(listener.address, timeout=30) as garbage:
            garbage.sendall(b"\xff\x00GET / HTTP/1.1\r\n\r\n" * 50)
        with socket.create_connection(listener.address, timeout=30) as huge:
            huge.sendall(b"\x7f\xff\xff\xff")  # a 2 GiB message announced in reply to the challenge
        stranger = Client(listener.address, authkey=KEY)
        stranger.send({"rank": 0})  # proves the key, then says something that is not a Hello
        outcome["stranger closed"] = stranger.poll(30) and _closed(stranger)
        _join(listener.address, 1)  # the silent one is still held open: the replica joins all the same

    threading.Thread(target=strangers_then_a_replica, daemon=True).start()
    try:
        assert wait_until(lambda: len(front.hellos) == 1, timeout=30)
        assert front.hellos[0].rank == 1 and listener.joined == 1
        assert outcome["stranger closed"] and listener.refused == 4
    finally:
        held.close()
        listener.close()


def _closed(conn) -> bool:
    try:
        conn.recv()
    except (EOFError, OSError):
        return True
    return False


def test_a_silent_connection_is_cut_at_the_deadline(front):
    listener = ReplicaListener("127.0.0.1", KEY, front.joined, handshake_s=0.5)
    try:
        with _silent(listener.address) as held:
            challenge = held.recv(64)  # the listener's challenge, which it never answers
            assert challenge
            assert held.recv(64) == b""  # cut: the listener shut it down (the timeout would raise instead)
        assert wait_until(lambda: listener.refused == 1, timeout=30)
        _join(listener.address, 0)
        assert wait_until(lambda: len(front.hellos) == 1, timeout=30)
    finally:
        listener.close()


def test_connections_beyond_the_handshake_limit_are_closed_and_a_replica_joins_after(front):
    listener = ReplicaListener("127.0.0.1", KEY, front.joined, handshake_s=1, max_handshakes=2)
    try:
        held = [_silent(listener.address) for _ in range(2)]
        for sock in held:
            assert sock.recv(64)  # each got its challenge: both handshakes are under way
        with _silent(listener.address) as third:
            assert third.recv(64) == b""  # over the limit: closed at once, no challenge
        for sock in held:
            assert sock.recv(64) == b""  # cut at the deadline, freeing their places
            sock.close()
        _join(listener.address, 0)
        assert wait_until(lambda: len(front.hellos) == 1, timeout=30)
        assert listener.refused == 3
    finally:
        listener.close()


def test_a_replica_turned_away_at_the_limit_tries_again_and_joins(front):
    from nanoserve.dp.replica import connect

    listener = ReplicaListener("127.0.0.1", KEY, front.joined, handshake_s=1, max_handshakes=1)
    try:
        with _silent(listener.address) as held:
            assert held.recv(64)  # its handshake takes the one place, until it is cut
            conn = connect(listener.address, KEY, within_s=30)
        conn.send(m.Hello(0, os.getpid(), "here", None))
        assert wait_until(lambda: len(front.hellos) == 1, timeout=30)
        assert listener.refused >= 2  # the replica's first try, and the silent one
        conn.close()
    finally:
        listener.close()
