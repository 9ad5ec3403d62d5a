"""The load screen: fire N requests at concurrency C through the loopback server and summarise the run.

It is `nanoserve bench serve` inside the console: the same request bodies, the same per-request measurement,
the same summary, and the same refusal to call an uncrowded run a serving figure.
"""

from __future__ import annotations

import asyncio
import time

from textual import on
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.widgets import Button, Input, Label, ProgressBar, Select, Static

from console import keys
from console.screens.base import ConsoleScreen, positive_int
from nanoserve import client, workload

FIELDS = (  # id, label, default
    ("load-n", "requests", "32"),
    ("load-concurrency", "concurrency", "8"),
    ("load-output", "output tokens", "64"),
    ("load-input", "synthetic prompt tokens", "128"),
)


class LoadScreen(ConsoleScreen):
    DEFAULT_CSS = """
    LoadScreen #load-form { grid-size: 4; grid-columns: auto 1fr auto 1fr; height: auto; padding: 1 1 0 1; }
    LoadScreen #load-form Label { padding: 1 1 0 0; }
    LoadScreen #load-buttons { height: auto; padding: 0 1; }
    LoadScreen #load-buttons Button { margin-right: 2; }
    LoadScreen #load-progress { margin: 1 1 0 1; }
    LoadScreen #load-phase, LoadScreen #load-summary { padding: 0 1; }
    """
    BINDINGS = [
        keys.run("run_load", "load_run"),
        keys.stop("stop_load", "load_stop"),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.running = False
        self.summary: dict | None = None  # the latest finished run's summary row
        self.done = 0

    def compose_body(self) -> ComposeResult:
        with Grid(id="load-form"):
            for field_id, label, default in FIELDS:
                yield Label(label)
                yield Input(default, id=field_id, restrict=r"\d*")
            yield Label("prompts")
            yield Select([("built-in chat prompts", "builtin"), ("synthetic token prompts", "synthetic")],
                         value="builtin", allow_blank=False, id="load-dataset")
            yield Label("sampling")
            yield Select([("greedy", "greedy"), ("sampled (seeded)", "sampled")], value="greedy",
                         allow_blank=False, id="load-sampling")
        with Horizontal(id="load-buttons"):
            yield Button(keys.label("Run", keys.RUN), id="load-run-button", variant="primary")
            yield Button(keys.label("Stop", keys.STOP), id="load-stop-button", variant="error", disabled=True)
        yield ProgressBar(total=1, id="load-progress", show_eta=False)  # determinate: an idle bar never animates
        yield Static("no run yet", markup=False, id="load-phase")
        yield Static("", markup=False, id="load-summary")

    # ---- actions ------------------------------------------------------------------------------------
    def read_form(self) -> dict:
        """The run's settings; ValueError names the field that is wrong."""
        return {field_id: positive_int(self.query_one(f"#{field_id}", Input), label) for field_id, label, _ in FIELDS}

    @on(Button.Pressed, "#load-run-button")
    def action_run_load(self) -> None:
        if self.running:
            self.notify("a run is already going; stop it first ({keys.STOP})", severity="warning")
            return
        server = self.app.server
        if server is None or self.app.phase != "serving":
            self.notify("the engine is not serving yet; wait for it", severity="error")
            return
        try:
            form = self.read_form()
        except ValueError as e:
            self.notify(str(e), severity="error")
            return
        bodies = workload.make_bodies(
            form["load-n"], self.query_one("#load-dataset", Select).value, form["load-input"], form["load-output"],
            prompt_seed=int(time.time()), vocab=server.host.stats().vocab_size,
            sampled=self.query_one("#load-sampling", Select).value == "sampled")
        self.run_worker(self._fire(server.url, server.headers, bodies, form["load-concurrency"]), exclusive=True,
                        group="load")

    @on(Button.Pressed, "#load-stop-button")
    def action_stop_load(self) -> None:
        self.workers.cancel_group(self, "load")

    # ---- the run (an async worker on the app's loop; httpx does the waiting) ------------------------
    async def _fire(self, url: str, headers: dict, bodies: list[dict], concurrency: int) -> None:
        bar, phase = self.query_one("#load-progress", ProgressBar), self.query_one("#load-phase", Static)
        self._set_running(True)
        self.done = 0
        bar.update(total=len(bodies), progress=0)
        phase.update(f"running {len(bodies)} requests at concurrency {concurrency}…")

        def on_result(result) -> None:
            self.done += 1
            bar.advance(1)

        try:
            results, duration, peak = await client.fire(url, bodies, concurrency, None, headers, 0, on_result)
        except asyncio.CancelledError:
            phase.update(f"stopped after {self.done} of {len(bodies)} requests; the rest were aborted")
            raise
        finally:
            self._set_running(False)
        self.summary = {**client.summarise(results, duration), "peak_running_seen": peak}
        phase.update(f"done: {len(bodies)} requests in {duration:.1f} s")
        self.query_one("#load-summary", Static).update(format_summary(self.summary, concurrency))

    def _set_running(self, running: bool) -> None:
        self.running = running
        self.query_one("#load-run-button", Button).disabled = running
        self.query_one("#load-stop-button", Button).disabled = not running


def format_summary(row: dict, concurrency: int) -> str:
    def ms(key):
        return "-" if row.get(key) is None else f"{row[key]:.0f}"

    peak = row["peak_running_seen"]
    crowded = (f"crowded: up to {peak} requests ran at once" if peak >= 2 else
               f"NOT crowded: at most {peak} request ran at once, so this measured latency, not serving; "
               "raise concurrency or output tokens")
    return (f"successful {row['successful']}  failed {row['failed']}  duration {row['duration_s']:.1f} s\n"
            f"throughput {row['output_tok_per_s']:.1f} output tok/s  {row['req_per_s']:.2f} req/s "
            f"(concurrency {concurrency})\n"
            f"TTFT ms    p50 {ms('ttft_median_ms')}  p99 {ms('ttft_p99_ms')}\n"
            f"TPOT ms    p50 {ms('tpot_median_ms')}  p99 {ms('tpot_p99_ms')}\n"
            f"{crowded}")
