"""The dashboard: every panel refreshed from one engine snapshot per tick."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.screen import Screen
from textual.widgets import Footer, Static

from console.panels.features import FeaturePanel
from console.panels.header import EngineHeader
from console.panels.kv import KVPanel
from console.panels.read import ReadPanel
from console.panels.rows import RowsTable
from console.panels.throughput import ThroughputPanel

PANEL_TITLES = {"rows": "Requests", "kv": "KV cache", "throughput": "Throughput", "read": "Paged read",
                "capture": "Capture", "inputs": "Persistent inputs"}


class Dashboard(Screen):
    BINDINGS = [Binding("p", "toggle_pause", "Pause", id="pause")]

    def __init__(self, refresh_s: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.refresh_s = refresh_s
        self.paused = False
        self.ticks = 0  # timer ticks so far, paused or not (tests wait on it instead of sleeping)
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        yield Static("", markup=False, id="status")
        with Grid(id="panels"):
            yield RowsTable(id="rows")
            yield KVPanel(id="kv")
            yield ThroughputPanel(id="throughput")
            yield ReadPanel(id="read")
            yield FeaturePanel("capture", id="capture")
            yield FeaturePanel("inputs", id="inputs")
        yield Footer()

    def on_mount(self) -> None:
        for panel_id, title in PANEL_TITLES.items():
            self.query_one(f"#{panel_id}").border_title = title
        self.tick()
        self.set_interval(self.refresh_s, self.tick)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.tick()

    def tick(self) -> None:
        self.ticks += 1
        server, error = self.app.server, self.app.load_error
        status = self.query_one("#status", Static)
        if error is not None:
            status.update(f"failed to load: {error}")
            return
        if server is None:
            status.update(f"loading {self.app.config.model or 'the embedded default model'}… "
                          f"{time.monotonic() - self._started:.1f} s")
            return
        stats = server.host.stats()
        throughput = self.query_one(ThroughputPanel)
        throughput.sample(time.monotonic(), stats)
        status.update(f"serving {server.model_name} at {server.url}/v1" + ("  [PAUSED]" if self.paused else ""))
        if self.paused:
            return
        self.query_one(EngineHeader).show(stats)
        self.query_one(RowsTable).show(stats)
        self.query_one(KVPanel).show(stats)
        throughput.show(stats)
        self.query_one(ReadPanel).show(stats)
        for panel in self.query(FeaturePanel):
            panel.show(stats)
