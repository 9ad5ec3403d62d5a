"""The console hosted by Textual's pilot with its real stylesheet and a real engine on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

pytest.importorskip("textual")

from console.app import NanoserveConsole  # noqa: E402
from console.panels.features import OFF, FeaturePanel  # noqa: E402
from console.panels.rows import RowsTable  # noqa: E402
from console.screens.help import HelpScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import Requests, started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, device="cpu")


async def test_dashboard_follows_real_requests(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        assert app.server.url.startswith("http://127.0.0.1:")
        await wait_until(pilot, lambda: "max_model_len 128" in text(app, "#header"), 5, "the header")
        table = app.screen.query_one(RowsTable)
        assert table.row_count == 0
        for panel in app.screen.query(FeaturePanel):
            assert panel.content == OFF

        seen_rows = []
        thread = Requests(app.server.url, n=4, max_tokens=40)
        await wait_until(pilot, lambda: seen_rows.append(table.row_count) or table.row_count > 0 or
                         not thread.is_alive(), 30, "rows in the table")
        await wait_until(pilot, lambda: not thread.is_alive(), 30, "the requests to finish")
        assert not thread.errors
        await wait_until(pilot, lambda: "total 160" in text(app, "#throughput-text"), 5, "the generation total")
        finished = lambda: table.row_count and all(  # noqa: E731  finished rows stay, with their reason
            str(table.get_row_at(i)[1]).startswith("finished") for i in range(table.row_count))
        await wait_until(pilot, finished, 5, "every row to finish")
        assert max(seen_rows) > 0, "the rows table never showed a running request"
        assert "160 tokens" in text(app, "#kv")
        assert "finished    4" in text(app, "#throughput-text")
        server = app.server
    assert server is not None and not server.host.running  # quitting stopped the engine


async def test_pause_freezes_display_until_unpaused(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        await pilot.press("p")
        dashboard = app.screen
        assert dashboard.paused and "PAUSED" in text(app, "#status")
        frozen = {sel: text(app, sel) for sel in ("#kv", "#throughput-text", "#read")}
        requests = Requests(app.server.url, n=2, max_tokens=20)
        await asyncio.to_thread(requests.join, 30)
        assert not requests.errors
        # the data kept flowing (the host hands a step's outputs out before it publishes that step's counters)
        await wait_until(pilot, lambda: app.server.host.stats().scheduler.generation_tokens_total == 40, 5,
                         "the engine's generation total")
        ticks = dashboard.ticks
        await wait_until(pilot, lambda: dashboard.ticks >= ticks + 3, 5, "refresh ticks while paused")
        assert {sel: text(app, sel) for sel in frozen} == frozen
        await pilot.press("p")
        assert not dashboard.paused
        await wait_until(pilot, lambda: "total 40" in text(app, "#throughput-text"), 5, "the catch-up")
        assert "40 tokens" in text(app, "#kv")


async def test_help_opens_and_closes(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "the help screen")
        keys = str(app.screen.query_one("#help-keys").content)
        assert "Quit" in keys and "Pause" in keys and "Help" in keys
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), 5, "the help to close")
        await started(app, pilot)
        server = app.server
        await pilot.press("q")
    assert app.return_code == 0 and not server.host.running  # q quit the app, and quitting stopped the engine


async def test_quit_while_loading_stops_the_server(config, monkeypatch):
    """The load is held inside Server.start until the app has quit, so the load thread finds the app closing."""
    from nanoserve.server.serve import Server

    release, entered, started_servers = threading.Event(), threading.Event(), []
    original_start = Server.start

    def held_start(server):
        entered.set()
        if not release.wait(60):
            raise RuntimeError("the test never released the load")
        started_servers.append(original_start(server))
        return started_servers[-1]

    monkeypatch.setattr(Server, "start", held_start)
    app = NanoserveConsole(config, refresh_s=0.05)
    try:
        async with app.run_test() as pilot:
            await wait_until(pilot, entered.is_set, 60, "the load to reach Server.start")
            await pilot.press("q")
        assert not app.load_done.is_set()  # the app closed while the load was still held
    finally:
        release.set()
    assert await asyncio.to_thread(app.load_done.wait, 30)  # the load goes on, then stops what it started
    assert app.load_error is None and app.server is None
    (server,) = started_servers  # the HTTP server did start once released...
    assert not server.host.running  # ...and the load thread stopped it
    assert "serving" not in [phase for _, phase in app.phases]
    assert not [t for t in threading.enumerate() if t.name in ("nanoserve-engine", "nanoserve-http")]


async def test_inputs_panel_picks_up_the_published_section(config):
    import dataclasses

    app = NanoserveConsole(dataclasses.replace(config, persistent_inputs=True, decode_buckets=True), refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        requests = Requests(app.server.url, n=3, max_tokens=12)
        await wait_until(pilot, lambda: not requests.is_alive(), 30, "the requests")
        assert not requests.errors

        def steps_shown() -> int:
            found = re.search(r"^steps +(\d+)$", text(app, "#inputs"), re.MULTILINE)
            return int(found.group(1)) if found else 0

        await wait_until(pilot, lambda: steps_shown() > 0, 5, "decode steps in the inputs section")
        shown = text(app, "#inputs")
        assert "inputs:" in shown and "buckets:" in shown and "padded_rows" in shown
        assert re.search(r"^fresh_allocations +0$", shown, re.MULTILINE)  # persistent: none, however many steps
        assert text(app, "#capture") == OFF
