"""The installed `nanoserve-console` in a 100x30 pseudo-terminal (tests/test_console_terminal.py's Terminal):
one request sent to the server the console hosts finishes; Enter on its row of the dashboard's Requests table opens
its screen, whose rendered text shows its phases (queued, a prefill chunk, a decode run), its finish with the
reason, and its figures; Esc comes back to the dashboard."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

pytest.importorskip("pexpect")
pytest.importorskip("pyte")

from tests.test_console_terminal import Terminal, console_command  # noqa: E402

MAX_TOKENS = 8


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed) for the console's server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_finished(term: Terminal, rid: str, timeout: float) -> None:
    """Wait until the Requests table's row of `rid` says it finished."""
    deadline = time.monotonic() + timeout
    while not any(rid in line and "finish" in line for line in term.screen.display):
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid}'s row never said finished; the screen:\n{term.text()}")
        term.pump()


def test_a_finished_requests_screen_shows_its_phases_in_a_terminal(tiny_checkpoint):
    port = free_port()
    term = Terminal([console_command(), "--model", str(tiny_checkpoint("llama")), "--max-model-len", "256",
                     "--kv-cache-gib", "0.01", "--device", "cpu", "--refresh", "0.2", "--port", str(port)])
    try:
        term.wait_for("serving", 90)
        term.wait_for("TTFT", 30)  # the panels' first snapshot is drawn
        body = {"prompt": "request 0 says hello", "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "request_id": "phases"}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        answer.raise_for_status()
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        rid = answer.json()["id"]
        # the dashboard lists it as finished in the Requests table. Its state cell is read by its start alone: a
        # row first drawn while running keeps that width, and "finished (length)" shows cut to "finishe"
        row_finished(term, rid, 10)
        term.press("\t")  # nothing has the focus on arrival (the letter keys answer): Tab gives it to the table
        term.press("\r")  # Enter on the table's only row: the request's screen
        screen = term.wait_for(f"{rid}: finished, length", 10)
        lines = [line.strip() for line in screen.splitlines()]
        # its figures: queued, TTFT, TPOT, total; its tokens
        assert any(re.match(r"queued \d.* · TTFT \d.* · TPOT \d.* · total \d", line) for line in lines), screen
        assert f"{MAX_TOKENS} generated · 0 preemptions" in screen
        # its phases, one span a line under the time axis and its legend: queued, a prefill chunk, a decode run
        assert "· queued  ▓ prefill  █ decode  ! preempted" in screen
        spans = [line for line in lines if re.match(r"\d+\.\d{3} - +\d+\.\d{3} s  ", line)]
        kinds = [re.sub(r"^\S+ - +\S+ s  ", "", span) for span in spans]
        assert any(re.fullmatch(r"prefill chunk, \d+ tokens( \(\d+ already cached\))?", k) for k in kinds), screen
        assert any(re.match(r"decode, \d+ steps, \d+ tokens, sharing steps with", k) for k in kinds), screen
        phases = [k.split(",")[0].split()[0] for k in kinds]
        assert phases[0] == "queued" and phases.index("prefill") < phases.index("decode"), screen  # in that order
        assert "█" in screen and "▓" in screen.replace("▓ prefill", "")  # the axis draws prefill and decode
        assert "returned to the pool" in screen
        term.press("\x1b")  # Esc: back to the dashboard
        screen = term.wait_for("KV cache", 10)
        assert "Requests" in screen and "prefill chunk" not in screen
        row_finished(term, rid, 5)
        term.press("q")
    finally:
        status = term.close()
    assert status == 0
