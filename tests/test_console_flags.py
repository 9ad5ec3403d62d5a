"""The flags screen against a real engine: a change restarts it, /health shows the new flags, bad values never apply."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("textual")

from console.app import NanoserveConsole  # noqa: E402
from console.screens.flags import ConfirmRestart, FlagsScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import Requests, started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, device="cpu")


async def open_flags(app, pilot):
    await started(app, pilot)
    await pilot.press("f")
    await wait_until(pilot, lambda: isinstance(app.screen, FlagsScreen), 5, "the flags screen")
    return app.screen


def health(app) -> dict:
    return httpx.get(app.server.url + "/health", timeout=10).json()


async def test_flag_change_restarts_engine_and_health_shows_it(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_flags(app, pilot)
        url = app.server.url
        screen.query_one("#flag-max_num_seqs").value = "4"
        screen.query_one("#flag-max_num_batched_tokens").value = "96"
        screen.query_one("#flag-seed").value = "1"  # not a live flag: the change takes a restart
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmRestart), 5, "the confirmation")
        assert "max_num_seqs: 64 -> 4" in str(app.screen.query_one("#confirm-text").content)
        await pilot.press("y")
        await wait_until(pilot, lambda: app.restarts == 1, 60, "the restart")
        await wait_until(pilot, lambda: "restarted in" in text(app, "#flags-message"), 5, "the result line")
        progress = text(app, "#flags-progress")
        assert "stopping the engine" in progress and "loading weights" in progress and "ready" in progress
        assert app.server.url == url  # same server, same port: clients keep their address
        flags = health(app)["flags"]
        assert flags["max_num_seqs"] == 4 and flags["max_num_batched_tokens"] == 96
        assert app.config.max_num_seqs == 4
        await wait_until(pilot, lambda: "max_num_seqs=4" in text(app, "#header"), 5, "the header's flags")
        requests = Requests(app.server.url, n=6, max_tokens=8)  # the new engine serves, with at most 4 rows
        await wait_until(pilot, lambda: not requests.is_alive(), 60, "requests on the new engine")
        assert not requests.errors
        assert health(app)["scheduler"]["peak_running"] <= 4


async def test_live_flags_apply_at_the_next_step_with_no_restart(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_flags(app, pilot)
        engine = app.server.host.serving()
        screen.query_one("#flag-max_num_seqs").value = "2"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "applied live" in text(app, "#flags-message"), 10, "the live change")
        assert "max_num_seqs 64 -> 2; no restart" in text(app, "#flags-message")
        assert app.restarts == 0 and app.server.host.serving() is engine and app.config.max_num_seqs == 2
        requests = Requests(app.server.url, n=5, max_tokens=8)
        await wait_until(pilot, lambda: not requests.is_alive(), 60, "requests under the live limit")
        assert not requests.errors and health(app)["scheduler"]["peak_running"] <= 2
        assert [(c.name, c.who) for c in engine.knobs.log] == [("max_num_seqs", "console")]
        screen.query_one("#flag-max_num_seqs").value = "100"  # above what the engine started with
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "not applied" in text(app, "#flags-message"), 10, "the refusal")
        assert "goes live up to 64" in text(app, "#flags-message") and engine.config.max_num_seqs == 2


async def test_the_log_level_and_the_prefix_cache_reset_apply_at_once_and_are_logged(config):
    import logging

    logger = logging.getLogger("nanoserve")
    before = logger.level
    app = NanoserveConsole(config, refresh_s=0.05)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            screen = await open_flags(app, pilot)
            engine = app.server.host.serving()
            r = httpx.post(app.server.url + "/v1/completions", timeout=30,
                           json={"prompt": [5 + i for i in range(40)], "max_tokens": 2})  # two full blocks named
            assert r.status_code == 200
            screen.query_one("#ops-log-level").value = "DEBUG"
            await wait_until(pilot, lambda: "applied live" in text(app, "#flags-message"), 10, "the level")
            assert logger.getEffectiveLevel() == logging.DEBUG and app.restarts == 0
            assert engine.stats().features["live"]["log_level"] == "DEBUG"
            screen.query_one("#ops-reset-prefix").scroll_visible(animate=False)  # below the form
            await pilot.pause()
            await pilot.click("#ops-reset-prefix")
            await wait_until(pilot, lambda: "prefix cache reset" in text(app, "#flags-message"), 10, "the reset")
            assert "2 cached blocks forgotten" in text(app, "#flags-message")
            assert [(c.name, c.who, c.new) for c in engine.knobs.log] == \
                [("log_level", "console", "DEBUG"), ("prefix_cache", "console", "reset")]
            assert engine.stats().prefix_cache.cached_blocks == 0
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("field,value,message", [
    ("max_num_seqs", "many", "max_num_seqs must be an integer"),
    ("block_size", "24", "block_size must be a power of two"),
    ("max_num_batched_tokens", "8", "must be >= max_num_seqs"),
    ("stall_factor", "inf", "stall_factor must be a finite number"),  # a live flag: refused as typed
])
async def test_bad_values_are_refused_before_anything_restarts(config, field, value, message):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_flags(app, pilot)
        screen.query_one(f"#flag-{field}").value = value
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "not applied" in text(app, "#flags-message"), 5, "the refusal")
        assert message in text(app, "#flags-message")
        assert not isinstance(app.screen, ConfirmRestart) and app.restarts == 0
        await pilot.press("ctrl+n")  # reset puts the flags in force back
        assert screen.query_one(f"#flag-{field}").value == str(getattr(config, field))


async def test_flags_that_fail_to_load_restore_the_previous_engine(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_flags(app, pilot)
        screen.query_one("#flag-max_model_len").value = "100000"  # valid flag, but the model has 512 positions
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmRestart), 5, "the confirmation")
        await pilot.press("y")
        await wait_until(pilot, lambda: app.restarts == 1, 60, "the restart attempt")
        # the previous engine loads again before the line says so: seconds on a busy machine
        await wait_until(pilot, lambda: "previous ones were restored" in text(app, "#flags-message"), 60, "the result")
        assert "512 positions" in text(app, "#flags-message")
        assert health(app)["max_model_len"] == 128 and app.config.max_model_len == 128
        assert screen.query_one("#flag-max_model_len").value == "128"
        requests = Requests(app.server.url, n=2, max_tokens=4)
        await wait_until(pilot, lambda: not requests.is_alive(), 30, "requests on the restored engine")
        assert not requests.errors


async def test_cancelled_confirmation_changes_nothing(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_flags(app, pilot)
        screen.query_one("#flag-seed").value = "7"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmRestart), 5, "the confirmation")
        await pilot.press("n")
        await wait_until(pilot, lambda: "cancelled" in text(app, "#flags-message"), 5, "the cancel line")
        assert app.restarts == 0 and health(app)["flags"]["seed"] == 0


async def test_confirmation_says_what_its_drain_box_says_and_switches_say_on_or_off(config):
    """The line above the box follows it as it is toggled (never "aborted" above a checked "finish first"), the
    choice made in the dialog is the one applied, and a switch's state is written, not only coloured."""
    from textual.widgets import Checkbox, Switch

    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_flags(app, pilot)
        switch = screen.query_one("#flag-batch_invariant", Switch)
        marker = lambda: str(switch.parent.query_one(".switch-state").content)  # noqa: E731
        assert switch.value and marker() == "on"
        switch.value = False
        await pilot.pause()
        assert marker() == "off"
        switch.value = True
        screen.query_one("#flags-drain", Checkbox).value = True
        screen.query_one("#flag-seed").value = "7"
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmRestart), 5, "the confirmation")
        dialog = app.screen
        box = dialog.query_one("#confirm-drain", Checkbox)
        assert box.value and "finish first" in text(app, "#confirm-then")
        assert "X" in str(box.render())  # checked shows an X, not only a colour
        box.value = False
        await pilot.pause()
        assert "aborted" in text(app, "#confirm-then") and "finish" not in text(app, "#confirm-then")
        assert "X" not in str(box.render())
        box.value = True
        await pilot.pause()
        assert "finish first" in text(app, "#confirm-then")
        await pilot.press("n")
        await wait_until(pilot, lambda: "cancelled" in text(app, "#flags-message"), 5, "the cancel line")
