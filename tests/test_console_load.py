"""The load screen against a real engine: a run completes with a summary, moves the dashboard, and can be stopped."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from console.app import NanoserveConsole  # noqa: E402
from console.screens.dashboard import Dashboard  # noqa: E402
from console.screens.load import LoadScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import notes, pace, started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01, device="cpu")


async def open_load(app, pilot, **fields):
    await started(app, pilot)
    await pilot.press("l")
    await wait_until(pilot, lambda: isinstance(app.screen, LoadScreen), 5, "the load screen")
    screen = app.screen
    for field_id, value in fields.items():
        screen.query_one(f"#{field_id.replace('_', '-')}").value = value
    return screen


async def test_load_run_summarises_and_moves_the_dashboard(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_load(app, pilot, load_n="6", load_concurrency="3", load_output="12", load_input="16",
                                 load_dataset="synthetic", load_sampling="sampled")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: screen.summary is not None, 60, "the run to finish")
        summary = text(app, "#load-summary")
        assert "successful 6  failed 0" in summary
        assert "crowded: up to" in summary and screen.summary["peak_running_seen"] >= 2
        assert screen.summary["output_tok_per_s"] > 0 and screen.summary["ttft_p99_ms"] is not None
        # the host hands a step's outputs out before it publishes that step's counters: wait for the last step's
        await wait_until(pilot, lambda: app.server.host.stats().scheduler.generation_tokens_total == 72, 5,
                         "the engine's generation total")
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")
        await wait_until(pilot, lambda: "total 72" in text(app, "#throughput-text"), 5, "the dashboard's totals")
        assert "TTFT ms     p50" in text(app, "#throughput-text")
        assert "(last 6 requests)" in text(app, "#throughput-text")


async def test_stop_midway_aborts_the_rest_and_frees_blocks(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_load(app, pilot, load_n="12", load_concurrency="4", load_output="240",
                                 load_input="16", load_dataset="synthetic")
        pace(app.server.host.engine)  # the keys below must meet its requests still running
        await pilot.press("ctrl+r")
        stats = app.server.host.stats
        await wait_until(pilot, lambda: stats().scheduler.generation_tokens_total > 20, 60, "tokens flowing")
        await pilot.press("ctrl+b")
        await wait_until(pilot, lambda: not screen.running, 10, "the run to stop")
        assert "stopped after" in text(app, "#load-phase") and screen.summary is None
        await wait_until(pilot, lambda: stats().scheduler.running == 0 and stats().kv.blocks_used == 0, 10,
                         "the aborted requests to release their blocks")
        # How many requests ended on their own before the stop landed depends on the machine's speed; what
        # the stop guarantees is that the run ended early, that the ones in flight were aborted, and that
        # none is left waiting or holding blocks.
        scheduler = stats().scheduler
        assert screen.done < 12 and scheduler.waiting == 0
        assert scheduler.finished.get("abort", 0) >= 1


async def test_bad_field_refuses_to_start(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_load(app, pilot, load_concurrency="0")
        await pilot.press("ctrl+r")
        refusal = "concurrency must be a whole number >= 1, got '0'"
        await wait_until(pilot, lambda: refusal in notes(app), 5, "the refusal")
        assert not screen.running and app.server.host.stats().scheduler.steps == 0
        assert "no run yet" in text(app, "#load-phase")
