"""Console plumbing on a real engine: the log screen, command palette, help with binding ids, keymap, refresh, filter."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from textual.command import CommandPalette  # noqa: E402

from console.app import SCREENS, NanoserveConsole  # noqa: E402
from console.cli import main  # noqa: E402
from console.screens.dashboard import Dashboard  # noqa: E402
from console.screens.help import HelpScreen  # noqa: E402
from console.screens.log import LogScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import Requests, started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, device="cpu")


def log_lines(app) -> str:
    return "\n".join(strip.text for strip in app.screen.query_one("#log").lines)


async def test_every_screen_key_switches_and_keeps_header(config):
    app = NanoserveConsole(config, refresh_s=0.5)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        for name, (screen_class, key, _) in SCREENS.items():
            await pilot.press("escape", key)  # Esc first: a screen may have put the focus in a text field
            await wait_until(pilot, lambda cls=screen_class: isinstance(app.screen, cls), 5, f"the {name} screen")
            await wait_until(pilot, lambda: "max_model_len 128" in text(app, "#header"), 5, f"{name}'s header")
            assert "serving" in text(app, "#status")


async def test_log_screen_shows_engine_log_and_phases(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, LogScreen), 5, "the log screen")
        await wait_until(pilot, lambda: "engine ready" in log_lines(app), 5, "the engine's own log record")
        lines = log_lines(app)
        assert "INFO    nanoserve.engine" in lines and "CONSOLE engine: loading weights" in lines
        await pilot.press("x")
        await wait_until(pilot, lambda: log_lines(app) == "", 5, "the cleared log")
        app.set_phase("a phase from a worker thread")
        await wait_until(pilot, lambda: "a phase from a worker thread" in log_lines(app), 5, "a new line")


async def test_command_palette_runs_screen_actions(config):
    app = NanoserveConsole(config, refresh_s=0.5)  # busy timers slow the pilot's wait for idle in the palette
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for _, _, title in SCREENS.values():
            assert f"Go to {title}" in titles
        assert "Pause" in titles and "Help" in titles
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette), 5, "the palette")
        await pilot.press(*"engine", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, LogScreen), 5, "the palette's choice")


async def test_help_lists_binding_ids_and_keymap_remaps(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    app.set_keymap({"pause": "z"})
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "the help")
        keys = text(app, "#help-keys")
        assert "id pause" in keys and "id screen_flags" in keys and "--keymap" in keys
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")
        dashboard = app.screen
        await pilot.press("p")  # the old key no longer pauses
        await pilot.pause()
        assert not dashboard.paused and "PAUSED" not in text(app, "#status")
        await pilot.press("z")
        assert dashboard.paused and "PAUSED" in text(app, "#status")


def every_binding():
    """Every Binding of the app and of every screen the console can show, read from their classes."""
    from console.screens.base import ConsoleScreen
    from console.screens.flags import ConfirmRestart
    from console.screens.request import RequestScreen

    classes = [NanoserveConsole, ConsoleScreen, RequestScreen, ConfirmRestart, HelpScreen,
               *(cls for cls, _, _ in SCREENS.values())]
    return [b for cls in classes for b in cls.BINDINGS]


async def test_help_lists_every_binding_of_every_screen(config):
    """Help is generated from the BINDINGS, so it cannot drift: every id and key is listed (ctrl+r, ctrl+t,
    ctrl+b, ctrl+n, ctrl+s, [ and ] among them), with Enter on a Requests row, and it fits at 100x30 (it scrolls)."""
    from textual.keys import format_key

    app = NanoserveConsole(config, refresh_s=0.5)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "the help")
        listed = text(app, "#help-keys")
        for binding in every_binding():
            assert f"id {binding.id}" in listed, binding
            key = binding.key_display or " / ".join(format_key(k) for k in binding.key.split(","))
            assert key in listed, binding
        for key in ("ctrl+r", "ctrl+t", "ctrl+b", "ctrl+n", "ctrl+s", "[", "]", "Requests row"):
            assert key in listed, key
        assert app.screen.query_one("#help").size.height <= 30


async def test_refresh_keys_and_row_filter(config):
    app = NanoserveConsole(config, refresh_s=0.5)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        await pilot.press("plus")
        assert app.refresh_s == 0.25 and "refresh 0.25 s" in text(app, "#status")
        await pilot.press("minus", "minus")
        assert app.refresh_s == 1.0
        await pilot.press("plus", "plus", "plus")
        assert app.refresh_s == 0.1
        table = app.screen.query_one("#rows-table")
        await pilot.press("s", "s")  # the keyboard's sort: id, then state
        assert table.sort_column == "state"
        await pilot.press(*"s" * 9)  # past the last column: arrival order again
        assert table.sort_column is None
        await pilot.press("s", "s", "s", "s")
        assert (table.sort_column, table.sort_reverse) == ("generated", True)
        await pilot.press("slash")
        await pilot.press(*"no-such-request")
        assert table.filter_text == "no-such-request"
        requests = Requests(app.server.url, n=3, max_tokens=60)
        seen = []  # (rows the table shows, rows the engine is running), sampled together

        def sample() -> bool:
            seen.append((table.row_count, app.server.host.stats().scheduler.running))
            return not requests.is_alive()

        await wait_until(pilot, sample, 60, "the load")
        assert not requests.errors
        assert max(r for _, r in seen) > 0, "no request was ever running while the filter was on"
        assert max(shown for shown, _ in seen) == 0  # every row filtered out
        await pilot.press("escape")
        assert table.filter_text == ""
        requests = Requests(app.server.url, n=3, max_tokens=60)
        await wait_until(pilot, lambda: table.row_count > 0 or not requests.is_alive(), 60, "unfiltered rows")
        assert table.row_count > 0
        await wait_until(pilot, lambda: not requests.is_alive(), 60, "the second load")


def test_keymap_flag_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["--keymap", "quit"])
    assert "--keymap takes ID=KEYS" in capsys.readouterr().err


async def test_z_gives_the_requests_table_the_whole_height_and_back(tiny_checkpoint):
    app = NanoserveConsole(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01,
                                        device="cpu"), port=0, refresh_s=0.1)
    async with app.run_test(size=(150, 44)) as pilot:
        await started(app, pilot)
        rows, counters = app.screen.query_one("#rows"), app.screen.query_one("#lower")
        await pilot.pause(0.3)  # the panels have their first snapshot: their heights are settled
        beside = rows.size.height
        await pilot.press("z")
        await pilot.pause()
        zoomed = rows.size.height
        assert not counters.display and zoomed > beside + 10 and zoomed > 44 // 2
        await pilot.press("z")
        await pilot.pause()
        assert counters.display and rows.size.height < zoomed


async def test_enter_on_a_request_opens_its_timeline_which_follows_it_to_its_finish(tiny_checkpoint):
    """Enter on a running request's row: its screen, with its figures and spans, following it until it finishes
    (its reason, its answer, its blocks returned); Esc comes back to the dashboard."""
    from console.screens.request import RequestScreen

    app = NanoserveConsole(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01,
                                        device="cpu"), port=0, refresh_s=0.1)
    async with app.run_test(size=(150, 44)) as pilot:
        await started(app, pilot)
        table = app.screen.query_one("#rows-table")
        requests = Requests(app.server.url, n=1, max_tokens=200)
        await wait_until(pilot, lambda: table.row_count > 0, 30, "a running row")
        table.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, RequestScreen), 5, "the request screen")
        screen = app.screen
        await wait_until(pilot, lambda: screen.sequences, 10, "its timeline")
        shown = text(app, "#request-timeline")
        assert "prefill chunk" in shown and "TTFT" in shown and "queued" in shown
        await wait_until(pilot, lambda: not requests.is_alive(), 60, "the request")
        await wait_until(pilot, lambda: screen.sequences[0]["status"] == "finished", 10, "its finish")
        await pilot.pause(0.1)
        shown = text(app, "#request-timeline")
        assert "finished, length" in shown and "returned to the pool" in shown and "200 generated" in shown
        assert "request 0 says hello" in text(app, "#request-prompt")
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")


async def test_a_text_filter_finds_finished_requests_beyond_the_latest_hundred(config):
    """105 requests finish; the snapshot lists the latest 100, so the first is not among them. Filtering by its
    id searches the 1,000 the engine keeps, and its row comes back, finished, with its figures."""
    import httpx

    from nanoserve.timeline import FINISHED_ROWS

    app = NanoserveConsole(config, refresh_s=0.1)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        r = httpx.post(app.server.url + "/v1/completions", timeout=120,
                       json={"prompt": [[5, 6, 7 + i % 20] for i in range(FINISHED_ROWS + 5)], "max_tokens": 1,
                             "request_id": "old"})
        assert r.status_code == 200
        await wait_until(pilot, lambda: len(app.server.host.stats().finished_rows) == FINISHED_ROWS, 30,
                         "the snapshot's finished rows")
        assert "cmpl-old-0" not in {row.request_id for row in app.server.host.stats().finished_rows}
        table = app.screen.query_one("#rows-table")
        await pilot.press("slash", *"old-0")
        await wait_until(pilot, lambda: table.row_count == 1, 10, "the searched row")
        row = table.get_row("cmpl-old-0")
        assert row[1] == "finished (length)" and row[3] == 1
        await pilot.press("escape")
        await wait_until(pilot, lambda: table.row_count == FINISHED_ROWS, 10, "the snapshot's rows again")
