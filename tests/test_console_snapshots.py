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
from tests.console_helpers import LOAD_S, held_still, wait_until  # noqa: E402

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
        await wait_until(pilot, lambda: app.phase == "serving", LOAD_S, "the engine")
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
    app.animation_level = "none"  # the tabs' underline slides as a label widens: a busy machine can catch it mid-way

    async def run_before(pilot) -> None:
        from console.panels.servers import ServerTabs, tab_label

        await wait_until(pilot, lambda: app.phase == "serving", 10, "the first server")
        tabs = app.screen.query_one(ServerTabs)
        await wait_until(pilot, lambda: all(str(tab.label) == tab_label(s) == f"{s.label} ok"
                                            for tab, s in zip(tabs.query("Tab"), servers)), 10, "both servers polled")
        table = app.screen.query_one(RowsTable)
        await wait_until(pilot, lambda: table.row_count == 34, 5, "every row")
        await wait_until(pilot, lambda: columns_fit_their_cells(table), 5, "the columns sized to their rows")
        await held_still(app, pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def finished_timeline() -> list[dict]:
    """One finished request's timeline as GET /requests/{id} gives it, with fixed times: queued, two prefill
    chunks (the first partly cached), a preemption and the decode runs around it."""
    spans = [
        {"kind": "queued", "start_s": 0.0, "end_s": 0.012},
        {"kind": "prefill", "start_s": 0.012, "end_s": 0.081, "tokens": 32, "cached": 16},
        {"kind": "prefill", "start_s": 0.081, "end_s": 0.140, "tokens": 21, "cached": 0},
        {"kind": "decode", "start_s": 0.140, "end_s": 0.620, "steps": 12, "tokens": 12, "mean_rows": 3.5,
         "most_rows": 6, "drafted": 0, "kept": 0},
        {"kind": "preempted", "start_s": 0.620, "end_s": 0.620},
        {"kind": "decode", "start_s": 0.700, "end_s": 1.180, "steps": 12, "tokens": 12, "mean_rows": 2.0,
         "most_rows": 3, "drafted": 0, "kept": 0},
    ]
    return [{"name": "chatcmpl-7f46a039", "status": "finished", "finish_reason": "length", "queued_s": 0.012,
             "ttft_s": 0.140, "tpot_s": 0.045, "total_s": 1.180, "tokens_per_s": 22.1, "prompt_tokens": 53,
             "cached_tokens": 16, "output_tokens": 24, "preemptions": 1, "drafted": 0, "kept": 0,
             "grammar_mask_s": None, "spans": spans, "blocks": [],
             "params": {"temperature": 0.7, "top_p": 0.95, "top_k": None, "max_tokens": 24, "seed": 7, "n": 1,
                        "structured": False},
             "prompt": "What is the capital of France? Answer in one sentence, then name its river.",
             "answer": "The capital of France is Paris, which lies on the Seine."}]


@SIZES
def test_request_screen_snapshot(snap_compare, size):
    """Enter on a Requests row: the request's timeline (time axis, spans, figures, sampling), prompt and answer."""
    from console.panels.rows import RowsTable
    from console.screens.request import RequestScreen
    from tests.test_console_panels import busy_snapshot, still_server

    server = still_server(busy_snapshot())
    server.host.timeline = lambda request_id: finished_timeline()
    app = NanoserveConsole(EngineConfig(), refresh_s=0.1, servers=[server])

    async def run_before(pilot) -> None:
        await wait_until(pilot, lambda: app.phase == "serving", 10, "the server")
        await wait_until(pilot, lambda: app.screen.query_one(RowsTable).row_count == 34, 5, "every row")
        app.screen.query_one(RowsTable).focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, RequestScreen) and app.screen.sequences, 5,
                         "the request's timeline")
        await held_still(app, pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)
