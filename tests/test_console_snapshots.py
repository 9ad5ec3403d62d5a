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
MID = (120, 40)  # the new user's terminal in issue 44
SMALL = (100, 30)  # a terminal as small as people run it in: every figure must still be in reach
SIZES = pytest.mark.parametrize("size", [SIZE, MID, SMALL], ids=["150x44", "120x40", "100x30"])


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
@SIZES
def test_screen_snapshot(snap_compare, model_dir, mode, keys, size):
    assert snap_compare(console(model_dir), terminal_size=size, run_before=arrive(mode, *keys))


def columns_fit_their_cells(table) -> bool:
    """Each column of a DataTable is as wide as its widest cell: the rows have been measured, not only added (a
    busy machine can take the picture in between, with the header still at its labels' widths)."""
    from rich.text import Text

    def width(value) -> int:
        return (value if isinstance(value, Text) else Text(str(value))).cell_len

    return all(column.content_width >= max((width(v) for v in table.get_column(key)), default=0)
               for key, column in table.columns.items())


@SIZES
def test_attached_busy_snapshot(snap_compare, size):
    """Attached to two servers whose snapshots hold still: 8 running and 26 finished requests (running listed
    first), the sliding windows, a stall, a linear section with None in it, a long flags line. Still snapshots
    make every figure fixed (the token rates are 0)."""
    from console.panels.rows import RowsTable
    from tests.test_console_panels import busy_snapshot, still_server

    servers = [still_server(busy_snapshot()), still_server(busy_snapshot())]
    servers[1].url = "http://127.0.0.1:10"
    app = NanoserveConsole(EngineConfig(), refresh_s=0.1, servers=servers)

    async def run_before(pilot) -> None:
        await wait_until(pilot, lambda: app.phase == "serving", 10, "the first server")
        table = app.screen.query_one(RowsTable)
        await wait_until(pilot, lambda: table.row_count == 34, 5, "every row")
        await wait_until(pilot, lambda: columns_fit_their_cells(table), 5, "the columns sized to their rows")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=size, run_before=run_before)
