"""Console panels fed hand-made snapshots: the keyed row diff, token rates, and sections the engine may publish."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("textual")

from textual.app import App  # noqa: E402

from console.cli import main  # noqa: E402
from console.panels.features import OFF, FeaturePanel  # noqa: E402
from console.panels.header import header_text  # noqa: E402
from console.panels.rows import RowsTable  # noqa: E402
from console.panels.throughput import TokenRates  # noqa: E402
from nanoserve.attention.dispatch import ReadStats  # noqa: E402
from nanoserve.stats import EngineStats, KVStats, Numerics, RowStats, SchedulerStats  # noqa: E402


def snapshot(rows=(), prompt_total=0, generation_total=0, features=None, finished=()) -> EngineStats:
    return EngineStats(
        model="m", device="cpu", dtype="float32", max_model_len=128, flags={"block_size": 16},
        scheduler=SchedulerStats(running=len(rows), waiting=0, peak_running=len(rows), preemptions=0,
                                 finished={}, prompt_tokens_total=prompt_total,
                                 generation_tokens_total=generation_total, steps=0),
        kv=KVStats(block_size=16, blocks_total=10, blocks_free=10, blocks_used=0, bytes=0),
        paged_read=ReadStats("gathered", None), rows=tuple(rows), features=dict(features or {}),
        finished_rows=tuple(finished),
    )


class Host(App):
    def compose(self):
        yield RowsTable()
        yield FeaturePanel("capture")
        yield FeaturePanel("inputs")


def row(rid, generated=0, state="running"):
    return RowStats(request_id=rid, state=state, prompt_tokens=5, generated_tokens=generated, blocks=1,
                    tokens_per_s=generated * 0.83)


async def test_rows_table_keyed_diff():
    app = Host()
    async with app.run_test() as pilot:
        table = app.query_one(RowsTable)
        table.show(snapshot([row("a"), row("b", state="waiting")]))
        await pilot.pause()
        assert [k.value for k in table.rows] == ["a", "b"]
        table.show(snapshot([row("b", 3), row("c")]))
        await pilot.pause()
        assert [k.value for k in table.rows] == ["b", "c"]
        assert table.get_row("b") == ["b", "running", 5, 3, 2.5, "-", "-", "-", 1, "-"]  # changed cells in place
        table.show(snapshot())
        assert table.row_count == 0


async def test_rows_table_sort_holds_and_filter_narrows():
    app = Host()
    async with app.run_test() as pilot:
        table = app.query_one(RowsTable)
        table.sort_column, table.sort_reverse = "generated", True
        table.show(snapshot([row("a", 1), row("b", 7), row("c", 4)]))
        await pilot.pause()
        assert [table.get_row_at(i)[0] for i in range(3)] == ["b", "c", "a"]
        table.show(snapshot([row("a", 9), row("b", 7), row("c", 4), row("d", 5, state="waiting")]))
        await pilot.pause()
        assert [table.get_row_at(i)[0] for i in range(4)] == ["a", "b", "d", "c"]  # re-sorted on change
        table.set_filter("wait")
        table.show(snapshot([row("a", 9), row("d", 5, state="waiting")]))
        await pilot.pause()
        assert [table.get_row_at(i)[0] for i in range(table.row_count)] == ["d"]
        table.set_filter("")
        table.show(snapshot([row("a", 9), row("d", 5, state="waiting")]))
        assert table.row_count == 2


async def test_finished_requests_stay_in_the_table_with_their_reason_and_sort_by_ttft():
    """Finished rows follow the live ones with their finish reason and latency figures; sorting by TTFT puts
    the slowest first and the rows without a first token yet last."""
    done = [dataclasses.replace(row("f1", 8, state="finished"), finish_reason="length", ttft_s=0.5, tpot_s=0.01,
                                total_s=0.6),
            dataclasses.replace(row("f2", 3, state="finished"), finish_reason="stop", ttft_s=2.0, tpot_s=0.02,
                                total_s=2.1)]
    app = Host()
    async with app.run_test() as pilot:
        table = app.query_one(RowsTable)
        live = dataclasses.replace(row("a", 4), ttft_s=0.1, tpot_s=0.005, total_s=0.2)
        table.show(snapshot([live, row("w", state="waiting")], finished=done))
        await pilot.pause()
        assert table.get_row("f2")[:8] == ["f2", "finished (stop)", 5, 3, 2.5, 2000.0, 20.0, 2.1]
        while table.sort_column != "ttft":
            table.cycle_sort()
        assert table.sort_reverse  # the slowest first
        assert [table.get_row_at(i)[0] for i in range(4)] == ["f2", "f1", "a", "w"]


async def test_feature_panels_show_published_sections_only():
    app = Host()
    async with app.run_test():
        capture, inputs = app.query(FeaturePanel)
        for panel in (capture, inputs):
            panel.show(snapshot())
            assert panel.content == OFF
        published = snapshot(features={"capture": {"layers": 4, "captured": 12}})  # a future engine's capture section
        capture.show(published)
        inputs.show(published)
        assert "layers" in capture.content and "12" in capture.content
        assert inputs.content == OFF


def test_header_says_what_runs_and_falls_back_to_the_dtype_for_an_older_server():
    runs = Numerics("int4 (head int8g32, rest float32)", "bfloat16 in linears, float32", "float32")
    model, numerics, flags = header_text(dataclasses.replace(snapshot(), numerics=runs)).splitlines()
    assert model == "m · cpu · max_model_len 128" and flags == "flags: all default (f: all)"
    assert numerics == "weights int4 (head int8g32, rest float32) · activations bfloat16 in linears, float32 · " \
                       "KV float32"
    assert header_text(snapshot()).splitlines()[1] == "float32"  # a snapshot without numerics: its dtype
    from console.panels.header import flags_text

    assert flags_text({"block_size": 16, "max_num_seqs": 8}) == "flags: max_num_seqs=8 (others default; f: all)"


def test_token_rates_window_and_restart():
    rates = TokenRates(window_s=2.0)
    assert rates.rates() == (0.0, 0.0)
    for t in range(5):
        rates.add(float(t), snapshot(prompt_total=100 * t, generation_total=10 * t))
    assert rates.rates() == (100.0, 10.0)
    assert len(rates.samples) <= 4
    assert list(rates.generation_history)[-1] == 10.0
    rates.add(5.0, snapshot())  # a restarted engine counts from zero again: no negative rate
    assert rates.rates() == (0.0, 0.0)


def test_main_help_lists_engine_flags_and_port(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--port" in out and "--max-num-seqs" in out


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "num_drafts": 10, "num_draft_tokens": 40,
        "num_accepted_tokens": 30, "num_accepted_tokens_per_pos": [10, 9, 6, 5], "acceptance_rate": 0.75,
        "mean_acceptance_length": 4.0, "stood_down_steps": 2, "stood_down_requests": 1, "grammar_cut_tokens": 3,
        "drafting_steps_s": 0.25, "drafting_steps_tokens": 40, "plain_steps_s": 1.0, "plain_steps_tokens": 100}


class SpecHost(App):
    def compose(self):
        from console.panels.speculation import SpeculationPanel

        yield SpeculationPanel()
        yield RowsTable()


async def test_the_speculation_panel_shows_totals_the_last_window_and_each_request(monkeypatch):
    """Totals since start, the difference over the window between snapshots, kept share by position and the
    stand-downs; hidden (OFF) without the section; each request's kept share in the Requests table."""
    import console.panels.speculation as panel_module

    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(panel_module, "monotonic", lambda: next(clock))
    app = SpecHost()
    async with app.run_test() as pilot:
        panel = app.query_one(panel_module.SpeculationPanel)
        panel.show(snapshot(features={"speculative": SPEC}))
        first = panel._text
        assert ("since start: 10 drafts, 75.0% of 40 drafted tokens kept, 4.00 tokens a drafting step; decode steps "
                "with drafts 160.0 tok/s, without 100.0: 1.60x") in first
        assert "last 10 s" not in first and "kept by position: 100.0% 90.0% 60.0% 50.0%" in first
        assert "2 crowded steps, 1 requests keeping too few, 3 drafted tokens cut by a grammar" in first
        later = {**SPEC, "num_drafts": 14, "num_draft_tokens": 56, "num_accepted_tokens": 34,
                 "drafting_steps_s": 0.35, "drafting_steps_tokens": 48, "plain_steps_s": 1.5, "plain_steps_tokens": 150}
        panel.show(snapshot(features={"speculative": later}))
        assert ("last 10 s: 4 drafts, 25.0% of 16 drafted tokens kept, 2.00 tokens a drafting step; decode steps "
                "with drafts 80.0 tok/s, without 100.0: 0.80x") in panel._text
        panel.show(snapshot())
        assert panel._text == OFF and not panel.published
        table = app.query_one(RowsTable)
        table.show(snapshot([dataclasses.replace(row("a", 9), spec_draft_tokens=8, spec_accepted_tokens=6)]))
        await pilot.pause()
        assert table.get_row("a")[-1] == "75% of 8"


class ShortRowsHost(App):
    CSS = "RowsPanel { height: 7; border: round $primary; }"  # 5 lines inside: the header and 4 rows

    def compose(self):
        from console.panels.rows import RowsPanel

        yield RowsPanel()


async def test_the_requests_panel_says_how_many_rows_its_height_or_filter_leaves_out():
    from console.panels.rows import RowsPanel

    app = ShortRowsHost()
    async with app.run_test(size=(160, 20)) as pilot:  # wide enough for every column: no horizontal scrollbar
        panel = app.query_one(RowsPanel)
        eight = snapshot([row(f"r{i}", i) for i in range(8)])
        panel.show(eight)
        await pilot.pause()
        panel.show(eight)  # laid out now: the table knows its height
        assert panel.border_subtitle == "showing 4 of 8 · z: full height"
        panel.show(snapshot([row(f"r{i}", i) for i in range(3)]))
        assert panel.border_subtitle == ""  # every row in view
        panel.query_one(RowsTable).set_filter("r1")
        panel.show(eight)
        assert panel.border_subtitle == "showing 1 of 8 · the rest filtered out"


class StillHost:
    """An attached server's host that never polls: `stats()` is the snapshot a test put there."""

    def __init__(self, stats: EngineStats):
        import time

        from console.remote import Health

        self.snapshot, self.fetched_at, self.model_name = stats, time.monotonic(), None
        self.health = Health("ok", at=time.monotonic())

    def start(self):
        return self

    def stop(self) -> None:
        pass

    def wait_polled(self, polls: int = 1, timeout: float = 10.0) -> bool:
        return True

    def stats(self) -> EngineStats:
        return self.snapshot

    def timeline(self, request_id: str) -> list[dict]:
        return []


def still_server(stats: EngineStats):
    from console.remote import AttachedServer

    server = AttachedServer("127.0.0.1:9")
    server.host = StillHost(stats)
    return server


async def test_the_stall_key_leaves_the_stalls_requests_alone_in_the_table_and_brings_every_row_back():
    """The latest stall named a, pair#1 (an n=2 request's second row) and one that has left the table: t keeps
    the two still listed, the subtitle says so, t or Esc brings every row back; Enter on a kept row opens it."""
    from console.app import NanoserveConsole
    from console.screens.dashboard import Dashboard
    from console.screens.request import RequestScreen
    from nanoserve.config import EngineConfig
    from nanoserve.windows import RecentActivity
    from tests.console_helpers import notes, started, text, wait_until

    rows = [row("a", 4), row("b", 2), row("pair", 3), row("pair#1", 3)]
    stall = {"kind": "step", "at": "12:00:03", "step_ms": 840.0, "p99_ms": 60.2, "decode_rows": 3,
             "prefill_tokens": 0, "preemptions": 0, "prefill_requests": [], "requests": ["a", "gone", "pair#1"]}
    server = still_server(snapshot(rows, finished=[row("c", 9, state="finished")]))
    app = NanoserveConsole(EngineConfig(), refresh_s=0.05, servers=[server])
    async with app.run_test(size=(150, 44)) as pilot:
        await started(app, pilot)
        table, panel = app.screen.query_one(RowsTable), app.screen.query_one("#rows")
        await wait_until(pilot, lambda: table.row_count == 5, 5, "every row")
        await pilot.press("t")
        assert "no stall recorded yet" in notes(app) and table.row_count == 5
        server.host.snapshot = snapshot(rows, finished=[row("c", 9, state="finished")],
                                        features={"stalls": {"stalls": 1, "throughput_drops": 0, "latest": [stall]},
                                                  "windows": RecentActivity().snapshot(10.0, 0.0)})
        await wait_until(pilot, lambda: "3 requests in it (t: list them)" in text(app, "#recent"), 5, "the stall")

        async def press_and_see(key: str, ids: list[str]) -> None:
            await pilot.press(key)
            await wait_until(pilot, lambda: sorted(k.value for k in table.rows) == ids, 5, f"rows {ids}")
            await pilot.pause(0.2)  # later snapshots keep the filter
            assert sorted(k.value for k in table.rows) == ids

        await press_and_see("t", ["a", "pair#1"])
        assert panel.border_subtitle == "requests in the stall at 12:00:03: 2 of 3 still listed · t or Esc: all"
        await press_and_see("t", ["a", "b", "c", "pair", "pair#1"])
        assert panel.border_subtitle == ""
        await press_and_see("t", ["a", "pair#1"])
        await press_and_see("escape", ["a", "b", "c", "pair", "pair#1"])
        await press_and_see("t", ["a", "pair#1"])
        table.focus()
        table.move_cursor(row=table.get_row_index("pair#1"))
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, RequestScreen), 5, "the request screen")
        assert app.screen.request_name == "pair#1"
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, Dashboard), 5, "the dashboard")
        assert table.has_focus  # Esc on the table, not a text field: every row again
        await press_and_see("escape", ["a", "b", "c", "pair", "pair#1"])


def test_recent_columns_never_run_together():
    """`--once --attach` printed "- / -320.8 / 2,547.3325.4 / 2,547.3": a cell as wide as its column touched the
    next. Every column is as wide as its widest cell, two spaces apart."""
    from console.panels.recent import recent_text

    def window(p50, p99):
        return {"seconds": 10.0, "finished_per_s": {"stop": 1.5}, **{f"{k}_p50_ms": p50 for k in ("ttft", "tpot", "step")},
                **{f"{k}_p99_ms": p99 for k in ("ttft", "tpot", "step")}}

    stats = snapshot(features={"windows": {"10s": window(None, None), "1m": window(320.8, 2547.3),
                                           "5m": window(325.4, 2547.3)}})
    lines = recent_text(stats).splitlines()
    ttft = next(line for line in lines if line.startswith("TTFT ms"))
    assert "- / -  " in ttft and "320.8 / 2,547.3  325.4 / 2,547.3" in ttft
    header = lines[0]
    assert header.index("1 min") + len("1 min") == ttft.index("320.8 / 2,547.3") + len("320.8 / 2,547.3")


def busy_snapshot() -> EngineStats:
    """What the new user's 2-core machine showed: 8 running and 26 finished requests with long ids, a linear
    section with None in it, the sliding windows and a stall."""
    from nanoserve.windows import RecentActivity

    running = [row(f"chatcmpl-{i:032x}", 12) for i in range(8)]
    finished = [row(f"chatcmpl-{100 + i:032x}", 40, state="finished") for i in range(26)]
    linear = {"format": "q4x16", "modules": 120, "dense_from_rows": {"q4x16 960x576": None, "q4x16 576x576": None},
              "int4_calls": 0}
    stall = {"kind": "step", "at": "12:00:03", "step_ms": 840.0, "p99_ms": 60.2, "decode_rows": 3,
             "prefill_tokens": 0, "preemptions": 0, "prefill_requests": [], "requests": ["a"]}
    features = {"linear": linear, "windows": RecentActivity().snapshot(10.0, 0.0),
                "stalls": {"stalls": 1, "throughput_drops": 0, "latest": [stall]}}
    flags = {f"flag_{i}": "x" * 12 for i in range(12)}  # a long flags line: it must wrap, not be cut
    return dataclasses.replace(snapshot(running, features=features, finished=finished), flags=flags)


@pytest.mark.parametrize("size", [(100, 30), (120, 40)], ids=["100x30", "120x40"])
async def test_every_dashboard_panel_is_reachable_and_running_requests_come_first(size):
    """At 100x30 and 120x40: the Requests table lists the running requests first, with every column in reach;
    every panel below it can be scrolled into full view; the header's flags line is whole; no raw None."""
    from console.app import NanoserveConsole
    from console.panels.rows import RowsTable
    from nanoserve.config import EngineConfig
    from tests.console_helpers import started, text, wait_until

    server = still_server(busy_snapshot())
    app = NanoserveConsole(EngineConfig(), refresh_s=0.05, servers=[server])
    async with app.run_test(size=size) as pilot:
        await started(app, pilot)
        table = app.screen.query_one(RowsTable)
        await wait_until(pilot, lambda: table.row_count == 34, 5, "every row")
        await pilot.pause(0.2)
        states = [table.get_row_at(i)[1] for i in range(table.row_count)]
        assert states == ["running"] * 8 + ["finished"] * 26
        assert table.visible_rows() >= 3
        assert table.virtual_size.width <= table.scrollable_content_region.width + 30  # the rest scrolls, and
        assert table.max_scroll_x == 0 or table.show_horizontal_scrollbar  # a scrollbar says there is more

        header = app.screen.query_one("#header")
        assert header.virtual_size.height <= header.size.height and "flag_11=" in text(app, "#header")

        lower = app.screen.query_one("#lower")
        for panel in app.screen.query("#lower > * > *, #features-off"):
            if not panel.display:
                continue
            lower.scroll_to_widget(panel, animate=False, top=True)
            await pilot.pause()
            inside = panel.region.intersection(lower.region)
            assert inside.height == min(panel.region.height, lower.region.height), panel.id
        assert app.screen.query_one("#recent").display and app.screen.query_one("#linear").display
        assert "never" in text(app, "#linear") and "None" not in text(app, "#linear")
