"""Helpers shared by the console's pilot tests: waiting on the live app, reading a widget's text or its
notifications, background load."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

BUSY_FLOOR_S = 30.0  # the least any wait allows
LOAD_S = 240.0  # an engine's first start on a fresh machine compiles the C kernels and times the head's forms


async def wait_until(pilot, predicate, timeout: float = 15.0, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds, or BUSY_FLOOR_S if that is more.

    A wait's `timeout` says what an idle machine needs; a 2-core machine running other work (CI beside a build, a
    suite beside another) can take several times that. A wait that holds returns as soon as it holds, so the
    floor costs a passing test nothing and only delays a failure's report."""
    timeout = max(timeout, BUSY_FLOOR_S)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def held_still(app, pilot, ticks: int = 3, interval: float = 0.15, timeout: float = 10.0) -> None:
    """Let the app run until its picture is the same `ticks` times running, `interval` apart (a snapshot's
    moment: a busy machine can leave a refresh half-applied when a fixed pause ends)."""
    timeout = max(timeout, BUSY_FLOOR_S)
    deadline = time.monotonic() + timeout
    last, same = None, 0
    while same < ticks:
        if time.monotonic() > deadline:
            raise AssertionError(f"the picture still changed after {timeout}s")
        await pilot.pause(interval)
        picture = app.export_screenshot()
        same = same + 1 if picture == last else 0
        last = picture


def text(app, selector: str) -> str:
    """The rendered content of the widget `selector` on the screen in view."""
    return str(app.screen.query_one(selector).content)


def notes(app) -> str:
    """The notifications (toasts) the app is showing, joined."""
    return " | ".join(n.message for n in app._notifications)


async def started(app, pilot, timeout: float = LOAD_S) -> None:
    """Wait until the console's engine and server are up and serving."""
    await wait_until(pilot, lambda: app.server is not None or app.load_error is not None, timeout, "the server")
    assert app.load_error is None, app.load_error
    await wait_until(pilot, lambda: app.phase == "serving", 5, "the serving phase")


class Requests(threading.Thread):
    """n concurrent completions sent from a background thread; it ends when all have answered."""

    def __init__(self, url: str, n: int = 4, max_tokens: int = 40):
        super().__init__(daemon=True)
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.errors: list[BaseException] = []
        self.start()

    def one(self, i: int) -> None:
        body = {"prompt": f"request {i} says hello", "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        try:
            httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).raise_for_status()
        except Exception as e:
            self.errors.append(e)

    def run(self) -> None:
        with ThreadPoolExecutor(self.n) as pool:
            list(pool.map(self.one, range(self.n)))


async def open_screen(app, pilot, key: str, screen_class, timeout: float = 5.0):
    """Wait for the engine, press the screen's key, and return the screen once it is in view."""
    await started(app, pilot)
    await pilot.press(key)
    await wait_until(pilot, lambda: isinstance(app.screen, screen_class), timeout, f"the {screen_class.__name__}")
    return app.screen


def pace(engine, seconds: float = 0.02) -> None:
    """Slow the engine's every step by `seconds`: the tiny model runs hundreds of tokens a second, and a key a
    test presses must meet its requests still running."""
    step = engine.runner.execute

    def paced(sched):
        time.sleep(seconds)
        return step(sched)

    engine.runner.execute = paced
