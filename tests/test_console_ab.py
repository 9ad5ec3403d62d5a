"""The A/B screen in Textual's pilot: a real run on the tiny checkpoint, Stop midway, and a refused flag."""

from __future__ import annotations

import dataclasses
import threading

import pytest

pytest.importorskip("textual")

from textual.widgets import DataTable, Input  # noqa: E402

from console import keys  # noqa: E402
from console.app import NanoserveConsole  # noqa: E402
from console.screens.ab import ABScreen  # noqa: E402
from nanoserve.ab import DEFAULT_B, NOT_EVIDENCE, variant  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01, device="cpu")


async def open_ab(app, pilot, **values) -> ABScreen:
    """Serving, on the A/B screen, with `values` typed into its inputs (by input id, '_' for '-')."""
    await started(app, pilot)
    await pilot.press("a")
    await wait_until(pilot, lambda: isinstance(app.screen, ABScreen), 5, "the A/B screen")
    for field_id, value in values.items():
        app.screen.query_one(f"#{field_id.replace('_', '-')}", Input).value = value
    return app.screen


def engine_threads() -> int:
    return sum(t.name == "nanoserve-engine" for t in threading.enumerate())


async def test_default_ab_run_plain_vs_fast_path_is_identical_and_shows_both_sides(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = await open_ab(app, pilot, num_prompts="6", max_tokens="16")
        assert screen.query_one("#flags-b", Input).value == DEFAULT_B
        await pilot.press("ctrl+r")
        assert screen.running
        await wait_until(pilot, lambda: not screen.running, 120, "the A/B run")
        assert screen.error is None, screen.error
        assert len(screen.verdicts) == 6 and all(v.identical for v in screen.verdicts)
        assert text(app, "#ab-summary").startswith("6/6 identical")
        assert "done" in text(app, "#ab-phase")
        counters = screen.query_one("#counters", DataTable)
        assert [str(c.label) for c in counters.columns.values()] == ["counter", "A", "B", "B vs A"]
        assert [str(cell) for cell in counters.get_row("flag decode_buckets")] == ["flag decode_buckets", "False",
                                                                                  "True", "differs"]
        padded = [str(cell) for cell in counters.get_row("buckets.padded_rows")][1:]
        assert padded[0] == "-" and int(padded[1].replace(",", "")) > 0 and padded[2] == "only B"  # B padded, A none
        generated = [str(cell) for cell in counters.get_row("scheduler.generation_tokens_total")][1:]
        assert generated[0] == generated[1] and generated[2] == "same"
        assert all(len(str(cell)) <= 34 for row in range(counters.row_count) for cell in counters.get_row_at(row))
        assert screen.query_one("#verdicts", DataTable).row_count == 6
        assert screen.ab.live == [] and engine_threads() == 1  # only the console's own engine is left
        assert not any(body["ignore_eos"] for body in screen.ab.bodies)  # answers end where the chat's do

        screen.query_one("#flags-b", Input).value = "streamed_read=on"  # refused: the verdict above must go
        await pilot.press("ctrl+r")
        assert screen.result is None and screen.verdicts == [] and counters.row_count == 0
        assert text(app, "#ab-summary").startswith("not started: B flags: streamed_read")


async def test_aa_runs_the_a_flags_on_both_arms_and_its_noise_discounts_a_later_ab(config):
    """A/A on its key: the same flags both sides. Without batch invariance the engine may differ from itself, and
    then the A/B verdict after it says its differences are no evidence (checked on a recorded noisy A/A)."""
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = await open_ab(app, pilot, num_prompts="4", max_tokens="8", flags_b="max_num_seqs=lots")
        await pilot.press(keys.AA)  # B's bad flag is not read: A/A runs A twice
        await wait_until(pilot, lambda: not screen.running and screen.result is not None, 120, "the A/A run")
        result = screen.result
        assert result.same_arms and result.a.config == result.b.config and result.all_identical
        assert text(app, "#ab-summary").startswith("A/A 4/4 identical")
        assert screen.aa_results[repr(result.a.config)] is result
        noisy = dataclasses.replace(result, verdicts=[dataclasses.replace(result.verdicts[0], identical=False),
                                                      *result.verdicts[1:]])
        other = dataclasses.replace(result, b=dataclasses.replace(result.b, config=variant(result.a.config,
                                                                                          "max_num_seqs=2")))
        assert NOT_EVIDENCE in noisy.summary() and noisy.summary().startswith("A/A 1 differ")
        assert NOT_EVIDENCE in other.summary(aa=noisy) and NOT_EVIDENCE not in other.summary(aa=result)


async def test_stop_midway_takes_the_servers_down(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = await open_ab(app, pilot, num_prompts="8", max_tokens="200", concurrency="4")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: screen.ab.phase == "firing A", 60, "engine A to take requests")
        engine_a = screen.ab.live[0].host
        await wait_until(pilot, lambda: engine_a.stats().kv.blocks_used > 0, 30, "rows holding blocks on A")
        await pilot.press("ctrl+b")
        await wait_until(pilot, lambda: not screen.running, 30, "the stop")
        assert screen.result is None and "stopped" in text(app, "#ab-phase")
        assert screen.ab.live == [] and screen.ab.a.blocks_held_after_stop == 0
        assert engine_threads() == 1


async def test_a_refusal_is_shown_whole_in_the_ab_screens_own_words(config):
    """The founding A/B (B = streamed_read=on) is refused by the engine's check, which names a CLI flag; the A/B
    screen says it as typed there (batch_invariant=off), whole, wrapped at 100 columns."""
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await open_ab(app, pilot, flags_b="streamed_read=on")
        await pilot.press("ctrl+r")
        assert not screen.running and screen.ab is None
        said = text(app, "#ab-summary")
        assert said.startswith("not started: B flags: streamed_read") and "batch_invariant=off" in said
        assert "--no-batch-invariant" not in said and said.endswith("(batch_invariant=off)")
        await pilot.pause()
        assert screen.query_one("#ab-summary").size.height >= 2  # wrapped, not cut at the edge


async def test_a_bad_flag_refuses_to_start(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = await open_ab(app, pilot, flags_b="max_num_seqs=lots")
        await pilot.click("#run")
        assert not screen.running and screen.ab is None
        assert "max_num_seqs must be an integer" in screen.error
        assert "not started" in text(app, "#ab-phase")
        flags_b = screen.query_one("#flags-b", Input)
        flags_b.value = "no_such_flag=1"
        flags_b.focus()
        await pilot.press("enter")
        assert screen.ab is None and "unknown engine flag 'no_such_flag'" in screen.error
        screen.query_one("#concurrency", Input).value = "0"
        flags_b.value = ""
        await pilot.press("enter")
        assert screen.ab is None and "concurrency must be a whole number >= 1" in screen.error
