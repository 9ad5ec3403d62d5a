"""Bodies that are promised and never sent, trickled, or sent where no body belongs: each is answered (408 past
the body deadline, 413 before a byte is read where no body is taken) and its connection closed, so clients
holding them cannot crowd out the others or make the server buffer for them."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.helpers import tiny_server_running, wait_until

KEY = "s3cret"
DEADLINE_S = 1.0
PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), api_key=KEY, body_timeout=DEADLINE_S,
                             limit_concurrency=20) as s:
        yield s


def _promise(server, method: str, path: str, length: int, key: bool = True) -> socket.socket:
    """A connection that sent a request's headers, promising `length` bytes of body, and none of them."""
    sock = socket.create_connection(server.address, timeout=30)
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode())
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_promised_body_never_sent_is_answered_408_and_closed(server):
    with _promise(server, "POST", "/v1/completions", 1000) as sock:
        started = time.monotonic()
        answer = _answer(sock)  # the server closes the connection after its answer
        assert time.monotonic() - started < DEADLINE_S + 20
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer


def test_a_trickled_body_is_cut_at_the_deadline(server):
    """A byte every 0.1 s keeps the connection busy but does not move the deadline: it counts from the start."""
    with _promise(server, "POST", "/v1/completions", 1000) as sock:
        sock.settimeout(0.1)
        started, answer = time.monotonic(), b""
        while time.monotonic() - started < DEADLINE_S + 20:
            try:
                sock.sendall(b" ")
                answer = sock.recv(65536)
                break
            except TimeoutError:
                continue
            except OSError:  # reset as it closed, before our read
                break
    assert answer.startswith(b"HTTP/1.1 408")


def test_a_body_to_a_route_that_takes_none_is_refused_unread(server):
    for method, path in [("POST", "/reset_prefix_cache"), ("GET", "/health"), ("GET", "/v1/models")]:
        with _promise(server, method, path, 4_000_000) as sock:
            answer = _answer(sock)  # at once: the 4 MB are never awaited
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer)
        assert b"this route takes no body" in answer
    r = httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200  # without a body it serves


def test_without_the_key_a_promised_body_is_never_awaited(server):
    """A caller without the key is answered before its body: 401 on a keyed route, 413 on an open one."""
    with _promise(server, "POST", "/v1/completions", 4_000_000, key=False) as sock:
        assert _answer(sock).startswith(b"HTTP/1.1 401")
    with _promise(server, "POST", "/health", 4_000_000, key=False) as sock:
        assert _answer(sock).startswith(b"HTTP/1.1 413")


def test_held_bodies_do_not_crowd_out_a_keyed_request(server):
    """More promised-but-unsent bodies to /health than the server's connection limit (20): each is refused at
    once, so a keyed request is served while their senders still hold their sockets open."""
    held = [_promise(server, "POST", "/health", 4_000_000, key=False) for _ in range(30)]
    try:
        def served() -> bool:
            r = httpx.post(server.url + "/v1/completions", json=PROMPT, headers={"Authorization": f"Bearer {KEY}"},
                           timeout=30)
            return r.status_code == 200

        assert wait_until(served, timeout=15, every=0.05)
    finally:
        for sock in held:
            sock.close()


def test_a_whole_body_within_the_deadline_is_served(server):
    r = httpx.post(server.url + "/v1/completions", json=PROMPT, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["choices"]
