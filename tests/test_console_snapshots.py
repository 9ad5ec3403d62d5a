"""Snapshot tests: every console screen in a deterministic state, rendered by the app itself, against its SVG.

Deterministic means: a fixed model directory name and server port, an idle engine (no request has run), and a
cleared log. Update after an intended change of look with `pytest tests/test_console_snapshots.py
--snapshot-update`, and look at the new SVGs before committing them.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("pytest_textual_snapshot")

from textual.widgets import Input  # noqa: E402

from console.app import SCREENS, NanoserveConsole  # noqa: E402
from console.screens.help import HelpScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import wait_until  # noqa: E402

PORT = 18765  # fixed so the URL on the status line is the same every run; below Linux's ephemeral range
SIZE = (150, 44)
SMALL = (100, 30)  # a terminal as small as people run it in: every figure must still show


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint under a fixed name: the name is on every screen's header and status line."""
    out = tmp_path_factory.mktemp("snapshots") / "tiny-llama"
    shutil.copytree(tiny_checkpoint("llama"), out)
    return out


def console(model_dir) -> NanoserveConsole:
    config = EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_gib=0.01, device="cpu", seed=0)
    return NanoserveConsole(config, port=PORT, refresh_s=0.1)


def arrive(mode: str, *keys: str):
    """run_before: wait for the engine, go to `mode`, press `keys`, and let two refreshes pass."""

    async def run_before(pilot) -> None:
        app = pilot.app
        await wait_until(pilot, lambda: app.phase == "serving", 60, "the engine")
        await pilot.press("escape", SCREENS[mode][1], *keys)
        screen_class = HelpScreen if "question_mark" in keys else SCREENS[mode][0]
        await wait_until(pilot, lambda: isinstance(app.screen, screen_class), 5, f"the {mode} screen")
        for field in app.screen.query(Input):  # a focused field's cursor blinks: hold it still for the picture
            field.cursor_blink = False
        await pilot.pause(0.3)

    return run_before


@pytest.mark.parametrize("mode,keys", [
    ("dashboard", ()),
    ("flags", ()),
    ("load", ()),
    ("chat", ()),
    ("ab", ()),
    ("log", ("x",)),
    ("dashboard", ("question_mark",)),
], ids=["dashboard", "flags", "load", "chat", "ab", "log", "help"])
@pytest.mark.parametrize("size", [SIZE, SMALL], ids=["150x44", "100x30"])
def test_screen_snapshot(snap_compare, model_dir, mode, keys, size):
    assert snap_compare(console(model_dir), terminal_size=size, run_before=arrive(mode, *keys))
