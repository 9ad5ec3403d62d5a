"""The installed `nanoserve-console` command in a real pseudo-terminal, as a user runs it: pexpect starts it at
100x30, pyte (a VT100 emulator) turns its output into the screen a terminal would show, and the test reads that
screen and types keys. What runs is the entry point pip installed, not the app class."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
pyte = pytest.importorskip("pyte")

COLUMNS, LINES = 100, 30


class Terminal:
    """A child process on a pty of COLUMNS x LINES, and the screen its output draws."""

    def __init__(self, argv: list[str]):
        self.screen = pyte.Screen(COLUMNS, LINES)
        self.stream = pyte.ByteStream(self.screen)
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(LINES)}
        self.child = pexpect.spawn(argv[0], argv[1:], dimensions=(LINES, COLUMNS), env=env)

    def text(self) -> str:
        return "\n".join(self.screen.display)

    def pump(self, seconds: float = 0.2) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.stream.feed(self.child.read_nonblocking(65536, timeout=0.05))
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                return

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if time.monotonic() > deadline or not self.child.isalive() and needle not in self.text():
                raise AssertionError(f"{needle!r} never showed; the screen:\n{self.text()}")
            self.pump()
        return self.text()

    def press(self, keys: str) -> None:
        self.child.send(keys)
        self.pump(0.3)

    def close(self, timeout: float = 30.0) -> int:
        """Wait for the child to exit (a quit stops its server first); kill it if it does not. Its exit status,
        or -1 when it had to be killed."""
        deadline = time.monotonic() + timeout
        while self.child.isalive() and time.monotonic() < deadline:
            self.pump(0.2)
        killed = self.child.isalive()
        if killed:
            self.child.terminate(force=True)
        self.child.close()
        return -1 if killed else self.child.exitstatus


def console_command() -> str:
    found = shutil.which("nanoserve-console", path=str(Path(sys.executable).parent)) or shutil.which("nanoserve-console")
    if found is None:
        pytest.fail("the nanoserve-console entry point is not installed; pip install -e . installs it")
    return found


def test_the_installed_console_runs_in_a_terminal(tiny_checkpoint):
    term = Terminal([console_command(), "--model", str(tiny_checkpoint("llama")), "--max-model-len", "256",
                     "--kv-cache-gib", "0.01", "--device", "cpu", "--refresh", "0.2"])
    try:
        term.wait_for("serving", 90)
        # the header can land before the panels' first snapshot is drawn: wait for the figures, then read the screen
        figures = ("running", "waiting", "TTFT", "mode")  # at 100x30 the table and the counters share the screen
        for figure in figures:
            screen = term.wait_for(figure, 30)
        assert all(figure in screen for figure in figures)
        assert "KV cache" in screen and "Throughput and latency" in screen and "Paged read" in screen
        assert "q Quit" in screen and "e Engine log" in screen  # the footer's keys, the last one too
        term.press("\t\t")  # past the Requests table into the panels below it, which scroll
        term.press("\x1b[6~")  # PageDown: the rest of the panels
        screen = term.wait_for("Recent (sliding windows)", 10)
        assert "saving" in screen or "Linear kernels" in screen or "off:" in screen
        assert "q Quit" in screen
        term.press("c")
        term.wait_for("Ask the model", 10)
        term.press("hi")  # the prompt has the focus: letters are text, not screen keys
        assert "Conversation" in term.text() and "hi" in term.text()
        term.press("\x1b")  # Esc: back to the screen keys
        term.press("f")
        term.wait_for("max_num_seqs", 10)
        term.press("q")
    finally:
        status = term.close()
    assert status == 0


def test_a_console_whose_model_does_not_load_says_why_and_exits_1(tmp_path):
    term = Terminal([console_command(), "--model", str(tmp_path / "missing")])
    try:
        screen = term.wait_for("did not load", 60)
        assert "missing" in screen
        term.press("q")
    finally:
        status = term.close()
    assert status == 1


def test_the_installed_console_attaches_to_two_servers(tiny_server):
    """`--attach` twice: the tabs, the dashboard of the first, and ] to the second (a dead one here)."""
    term = Terminal([console_command(), "--attach", tiny_server.url, "--attach", "127.0.0.1:9", "--refresh", "0.2"])
    try:
        screen = term.wait_for("(1 of 2", 30)
        host = tiny_server.url.removeprefix("http://")
        assert f"{host} ok" in screen
        term.wait_for("127.0.0.1:9 DOWN", 10)
        # the first server's panels come with its first snapshot, which may land after the tab bar: wait for them
        term.wait_for("KV cache", 30)
        term.wait_for("max_model_len 128", 30)
        term.press("]")
        term.wait_for("(2 of 2", 10)
        assert "unreachable" in term.text()
        term.press("q")
    finally:
        status = term.close()
    assert status == 0
