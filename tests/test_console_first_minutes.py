"""What a new user of the console ran into in its first ten minutes, each as a pilot test: typing goes where
the eye is, the way back to the screen keys is on screen, feedback lands in view, numbers read one way, an
unset flag shows what it came to, a failed load says why and exits non-zero."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from textual.widgets import Input  # noqa: E402

from console.app import NanoserveConsole  # noqa: E402
from console.cli import main  # noqa: E402
from console.numbers import by_reason, count, size  # noqa: E402
from console.screens.chat import ChatScreen  # noqa: E402
from console.screens.dashboard import Dashboard  # noqa: E402
from console.screens.flags import FlagsScreen  # noqa: E402
from console.screens.load import LoadScreen  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from tests.console_helpers import notes, open_screen, started, text, wait_until  # noqa: E402


@pytest.fixture
def config(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), kv_cache_gib=0.01, device="cpu")


def footer_keys(app) -> set[str]:
    """The keys the footer shows for the screen in view (enabled or greyed)."""
    return {active.binding.key for active in app.screen.active_bindings.values() if active.binding.show}


async def test_the_chat_prompt_has_the_focus_so_typing_asks(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await open_screen(app, pilot, "c", ChatScreen)
        await pilot.press(*"hello")  # h, e, l (load!), l, o: none of them may leave the chat
        assert isinstance(app.screen, ChatScreen)
        assert app.screen.query_one("#chat-input", Input).value == "hello"


async def test_a_text_field_says_how_to_get_the_screen_keys_back(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await open_screen(app, pilot, "l", LoadScreen)
        assert "escape" not in footer_keys(app)  # nothing to leave yet
        app.screen.query(Input).first().focus()
        await pilot.pause()
        assert "escape" in footer_keys(app)  # the footer says what gives the letters back
        await pilot.press("d")
        assert isinstance(app.screen, LoadScreen)  # the letter went into the field
        await pilot.press("escape", "d")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")


async def test_a_refused_flag_change_is_said_where_it_is_seen(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(180, 50)) as pilot:
        await open_screen(app, pilot, "f", FlagsScreen)
        app.screen.query_one("#flag-max_num_seqs", Input).value = ""
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: "not applied" in notes(app), 5, "the refusal's toast")
        assert "max_num_seqs" in notes(app)
        await pilot.pause(0.1)
        message = app.screen.query_one("#flags-message")
        assert 0 <= message.region.y < app.size.height and message.region.height > 0  # scrolled into view


async def test_an_unset_flag_shows_the_value_it_came_to(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(180, 50)) as pilot:
        await open_screen(app, pilot, "f", FlagsScreen)
        decided = app.server.host.serving().max_model_len
        field = app.screen.query_one("#flag-max_model_len", Input)
        await wait_until(pilot, lambda: str(decided) in field.placeholder, 5, "the decided value")
        assert field.value == ""  # still unset: applying the form keeps it decided at load
        assert app.screen.query_one("#flag-kv_cache_gib", Input).value == "0.01"  # set, so shown as set


def test_numbers_read_one_way():
    assert by_reason({}) == "none yet"
    assert by_reason({"stop": 3, "abort": 1, "length": 8}) == "length 8 · stop 3 · abort 1"
    assert count(4371840) == "4,371,840" and count(None) == "-"
    assert size(1073479680) == "1,023.8 MiB" and size(3 * 2**30) == "3.0 GiB" and size(512) == "512 B"


async def test_the_dashboard_writes_no_python_dicts(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        await wait_until(pilot, lambda: "finished" in text(app, "#throughput-text"), 5, "the throughput panel")
        shown = text(app, "#throughput-text")
        assert "{" not in shown and "none yet" in shown


async def test_a_model_that_does_not_load_says_why_on_screen(tmp_path):
    app = NanoserveConsole(EngineConfig(model=str(tmp_path / "missing")), refresh_s=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.load_error is not None, 30, "the failed load")
        await wait_until(pilot, lambda: "did not load" in text(app, "#status"), 10, "the reason on screen")
        status = app.screen.query_one("#status")
        assert "did not load" in text(app, "#status") and "missing" in text(app, "#status")
        assert status.has_class("failed") and status.region.height >= 2  # the whole reason, not one cut line


def test_a_failed_load_exits_non_zero(tmp_path, monkeypatch, capsys):
    def run_and_quit(self):
        self.load_error = FileNotFoundError(f"{tmp_path}/missing does not exist")

    monkeypatch.setattr(NanoserveConsole, "run", run_and_quit)
    assert main(["--model", str(tmp_path / "missing")]) == 1
    assert "did not load" in capsys.readouterr().err


def test_run_stop_and_reset_are_one_key_each_on_every_screen():
    from console import keys
    from console.screens.ab import ABScreen

    by_action = {}
    for screen in (LoadScreen, ABScreen, FlagsScreen, ChatScreen):
        for binding in screen.BINDINGS:
            kind = {"load_run": "run", "ab_run": "run", "load_stop": "stop", "ab_stop": "stop", "chat_stop": "stop",
                    "flags_reset": "reset", "chat_clear": "reset"}.get(binding.id)
            if kind:
                by_action.setdefault(kind, set()).add(binding.key)
    assert by_action == {"run": {keys.RUN}, "stop": {keys.STOP}, "reset": {keys.RESET}}
    from textual.widgets import Input as TextField

    taken = {key for b in TextField.BINDINGS for key in b.key.split(",")}
    assert not {keys.RUN, keys.STOP, keys.RESET, keys.APPLY} & taken  # they work inside a text field too


async def test_stop_works_while_a_field_has_the_focus(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await open_screen(app, pilot, "l", LoadScreen)
        screen = app.screen
        for field_id, value in (("load-n", "400"), ("load-concurrency", "4"), ("load-output", "200")):
            screen.query_one(f"#{field_id}", Input).value = value
        screen.query_one("#load-n", Input).focus()
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: screen.running, 10, "the run")
        await pilot.press("ctrl+b")  # the field keeps ctrl+x for cut: the shared stop key is not one of its keys
        await wait_until(pilot, lambda: not screen.running, 30, "the stop")
        assert "stopped after" in text(app, "#load-phase") and screen.done < 400


async def test_a_100x30_dashboard_reaches_every_figure_and_shows_every_key(config):
    from textual.widgets._footer import FooterKey

    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot)
        await wait_until(pilot, lambda: "TTFT" in text(app, "#throughput-text"), 5, "the panels")
        await pilot.pause(0.2)
        screen = app.screen
        assert screen.has_class("-narrow")
        for selector, words in (("#kv", ("running", "waiting", "generated", "usage")),
                                ("#throughput-text", ("TTFT", "TPOT", "step ms")),
                                ("#read", ("mode", "saving"))):
            widget = screen.query_one(selector)
            assert all(w in text(app, selector) for w in words), selector
            screen.query_one("#lower").scroll_to_widget(widget, animate=False)  # the panels scroll below the table
            await pilot.pause()
            region = widget.region
            assert region.height > 0 and region.bottom <= app.size.height - 1, (selector, region)  # above the footer
            assert region.right <= app.size.width
        keys = [k for k in screen.query(FooterKey) if k.display]
        assert keys and all(k.region.right <= app.size.width and k.region.width > 0 for k in keys)
        shown = {k.key for k in keys}
        assert {"q", "d", "f", "l", "c", "a", "e"} <= shown, shown


def test_published_sections_are_written_as_numbers_not_python():
    from console.panels.features import shown

    assert shown("packed_bytes", 66355200) == "63.3 MiB"
    assert shown("int4_calls", 7530) == "7,530"
    assert shown("dense_from_rows", {"int4 960x576": 32, "int4 576x576": 16}) == "int4 960x576 32 · int4 576x576 16"
    assert shown("head_us", {"own": 7231.6}) == "own 7,231.6"
    # None is a word with its meaning, never Python's: a linear with no dense copy never switches to one
    assert shown("dense_from_rows", {"q4x16 960x576": None, "q4x16 576x576": 64}) == \
        "q4x16 960x576 never · q4x16 576x576 64"
    assert shown("window", None) == "-" and shown("enabled", True) == "on" and shown("enabled", False) == "off"


def test_once_prints_the_dashboard_as_text(tiny_checkpoint, capsys):
    argv = ["--once", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "256", "--kv-cache-gib", "0.01",
            "--device", "cpu", "--refresh", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for title in ("== Requests ==", "== KV cache ==", "== Throughput and latency ==", "== Paged read =="):
        assert title in out
    assert "running" in out and "TTFT ms" in out and "saving" in out and "flags:" in out
    assert "off: capture" in out and "{" not in out


def test_once_with_a_model_that_does_not_load_exits_1(tmp_path, capsys):
    assert main(["--once", "--model", str(tmp_path / "missing")]) == 1
    assert "did not load" in capsys.readouterr().err


async def test_tab_reaches_a_labelled_control_first(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await open_screen(app, pilot, "f", FlagsScreen)
        await pilot.press("tab")
        assert app.focused is not None and app.focused.id and app.focused.id.startswith("flag-"), app.focused


def test_an_ab_arms_log_lines_name_the_arm():
    import logging
    import threading

    from nanoserve.ab import labelled_logs

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("nanoserve.engine")
    logger.addHandler(handler)
    try:
        with labelled_logs("A/B arm B"):
            logger.warning("engine ready: tiny (1.0s)")
            other = threading.Thread(target=lambda: logger.warning("the console's own engine"))
            other.start()
            other.join()
        logger.warning("after the arm")
    finally:
        logger.removeHandler(handler)
    assert records == ["A/B arm B: engine ready: tiny (1.0s)", "the console's own engine", "after the arm"]


async def test_the_dashboard_shows_the_sliding_windows(config):
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot)
        from tests.console_helpers import Requests

        Requests(app.server.url, n=4, max_tokens=8).join(60)
        await wait_until(pilot, lambda: "finished/s" in text(app, "#recent")
                         and " / " in text(app, "#recent").splitlines()[1], 10, "the windows")
        shown = text(app, "#recent")
        assert "10 s" in shown and "1 min" in shown and "5 min" in shown and "TTFT ms" in shown


def test_a_stall_is_shown_with_what_the_step_carried():
    from console.panels.recent import stall_line

    class Stats:  # only what the panel reads; the engine's own snapshot is tests/test_stalls.py
        features = {"stalls": {"stalls": 2, "throughput_drops": 0, "latest": [
            {"kind": "step", "at": "16:20:01", "step_ms": 840.0, "p99_ms": 60.2, "decode_rows": 12,
             "prefill_tokens": 2048, "preemptions": 1}]}}

    line = stall_line(Stats())
    assert line == ("STALLS 2 slow steps, 0 throughput drops; last at 16:20:01: step 840.0 ms (p99 60.2 ms), "
                    "12 decode rows, 2,048 prefill tokens, 1 preemptions")
    Stats.features["stalls"]["throughput_drops"] = 1
    Stats.features["stalls"]["latest"].append(
        {"kind": "throughput", "at": "16:21:00", "decode_tok_s": 11.5, "median_tok_s": 48.0, "decode_rows": 8.0,
         "prefill_tokens": 0, "preemptions": 0, "seconds": 1.02})
    assert stall_line(Stats()) == (
        "STALLS 2 slow steps, 1 throughput drops; last at 16:21:00: decode 11.5 tok/s (median 48.0) over 1.02 s, "
        "8.0 decode rows a step, 0 prefill tokens, 0 preemptions")
    Stats.features["stalls"]["latest"][-1].update(requests=[f"r{i}" for i in range(64)], requests_cut=True)
    assert stall_line(Stats()).endswith("0 preemptions; 64+ requests in it")  # --once: no key to press
    assert stall_line(Stats(), "t").endswith("0 preemptions; 64+ requests in it (t: list them)")


async def test_the_start_up_phase_clock_ticks_live_whatever_the_refresh(config):
    """A 6 s load once read "loading weights... 0.6 s" throughout: the phase's clock ticks on its own timer."""
    import re
    import threading

    release = threading.Event()

    app = NanoserveConsole(config, refresh_s=60.0)  # the dashboard's own refresh would not come for a minute

    def slow_load() -> None:  # a load that takes as long as the test says
        app.set_phase("loading weights")
        release.wait(30)

    app._load = slow_load
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: "loading weights" in text(app, "#status"), 5, "the loading phase")

            def seconds() -> float:
                return float(re.search(r"loading weights… ([\d.]+) s", text(app, "#status")).group(1))

            first = seconds()
            await wait_until(pilot, lambda: seconds() >= first + 0.5, 5, "the phase clock to tick")
    finally:
        release.set()
