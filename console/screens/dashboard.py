"""The dashboard: every panel refreshed from one engine snapshot per tick.

The requests table takes half the height; the panels share the other half in a scrolling area (Tab into it, then
arrows, PageDown or the wheel), so every panel is reachable however small the terminal, and none pushes another
off the screen. The counters sit in three columns, or two below base.NARROW columns (the paged read then wraps
under them and the sparklines go); the feature panels side by side, or one under another when narrow. A feature
the engine does not publish takes one line, not a panel.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Input, Static

from console.panels.features import FeaturePanel
from console.panels.header import EngineHeader
from console.panels.kv import KVPanel
from console.panels.read import ReadPanel
from console.panels.recent import STALL_KEY, RecentPanel, latest_stall
from console.panels.replicas import ReplicasPanel
from console.panels.rows import RowsPanel
from console.panels.speculation import SpeculationPanel
from console.panels.throughput import ThroughputPanel, TokenRates
from console.screens.base import ConsoleScreen
from nanoserve.stats import EngineStats

PANEL_TITLES = {"rows": "Requests", "kv": "KV cache", "throughput": "Throughput and latency",
                "read": "Paged read", "recent": "Recent (sliding windows)", "capture": "Capture", "inputs": "Persistent inputs",
                "linear": "Linear kernels", "parallel": "Tensor parallel", "speculation": "Speculation",
                "replicas": "Replicas"}
REFRESH_STEPS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)  # the refresh intervals +/- step through, seconds


class Dashboard(ConsoleScreen):
    BINDINGS = [
        Binding("p", "toggle_pause", "Pause", id="pause"),
        # the refresh interval is on the status line; these two stay out of the footer (help lists them)
        Binding("plus,equals_sign", "refresh_faster", "Faster", key_display="+", id="refresh_faster", show=False),
        Binding("minus", "refresh_slower", "Slower", key_display="-", id="refresh_slower", show=False),
        Binding("slash", "filter_rows", "Filter", key_display="/", id="filter_rows"),
        Binding("s", "sort_rows", "Sort", id="sort_rows"),
        Binding("z", "zoom_rows", "Zoom", id="zoom_rows"),
        # named on the Recent panel's stall line, beside the stall; the narrow footer has no room (help lists it)
        Binding(STALL_KEY, "stall_rows", "Stall's requests", id="stall_rows", show=False),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.paused = False
        self.ticks = 0  # timer ticks so far, paused or not (tests wait on it instead of sleeping)
        self._timer = None
        self._rates: dict[int, TokenRates] = {}

    def compose_body(self) -> ComposeResult:
        with Vertical(id="panels"):
            yield RowsPanel(id="rows")
            with VerticalScroll(id="lower"):  # every panel below the table, reachable by scrolling
                with Horizontal(id="counters"):
                    yield KVPanel(id="kv")
                    yield ThroughputPanel(id="throughput")
                    yield ReadPanel(id="read")
                with Horizontal(id="features"):
                    yield RecentPanel(id="recent")
                    yield FeaturePanel("capture", id="capture")
                    yield FeaturePanel("inputs", "buckets", id="inputs")
                    yield FeaturePanel("linear", id="linear")  # which kernel serves the linears, and how often
                    yield FeaturePanel("parallel", id="parallel")  # the group's ranks, their memory, collective time
                    yield SpeculationPanel(id="speculation")  # drafted and kept, since start and lately
                    yield ReplicasPanel(id="replicas")  # a data-parallel server's replicas, a line each
                yield Static("", markup=False, id="features-off")
        yield Static("", markup=False, id="no-snapshot")  # attached to a server that has not answered yet

    def on_mount(self) -> None:
        for panel_id, title in PANEL_TITLES.items():
            self.query_one(f"#{panel_id}").border_title = title



    def start_refresh(self) -> None:
        """One timer drives header, status and panels together."""
        self.tick()
        self._timer = self.set_interval(self.app.refresh_s, self.tick)

    # ---- actions ------------------------------------------------------------------------------------
    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.tick()

    def action_refresh_faster(self) -> None:
        self._set_refresh(max((s for s in REFRESH_STEPS if s < self.app.refresh_s), default=REFRESH_STEPS[0]))

    def action_refresh_slower(self) -> None:
        self._set_refresh(min((s for s in REFRESH_STEPS if s > self.app.refresh_s), default=REFRESH_STEPS[-1]))

    def action_filter_rows(self) -> None:
        self.query_one(RowsPanel).open_filter()

    def action_stall_rows(self) -> None:
        """The Requests table narrowed to the requests the latest stall carried (again, or Esc: every row)."""
        panel = self.query_one(RowsPanel)
        if panel.stall is not None:
            self._all_rows(panel)
            return
        stats = self.engine_stats()
        stall = latest_stall(stats)
        if stall is None:
            self.notify("no stall recorded yet", timeout=2)
        elif "requests" not in stall:
            self.notify("this server's stalls do not name their requests (it is older than this console)",
                        timeout=3)
        else:
            panel.show_stall(stall, STALL_KEY)
            self.redraw(stats)

    def _all_rows(self, panel: RowsPanel) -> None:
        panel.show_all()
        self.redraw(self.engine_stats())

    def on_key(self, event) -> None:
        """Esc outside a text field: every row again, when the table shows a stall's requests."""
        panel = self.query_one(RowsPanel)
        if event.key == "escape" and panel.stall is not None and not isinstance(self.focused, Input):
            event.stop()
            self._all_rows(panel)

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a request: its screen (timeline, figures, prompt and answer); Esc comes back."""
        from console.screens.request import RequestScreen

        if event.row_key.value is not None:
            self.app.push_screen(RequestScreen(event.row_key.value))

    def action_zoom_rows(self) -> None:
        """The Requests table alone, the whole height (again: the panels come back)."""
        self.toggle_class("-rows-zoomed")
        self.notify("requests: full height (z again: the panels)" if self.has_class("-rows-zoomed")
                    else "requests: beside the panels", timeout=2)

    def action_sort_rows(self) -> None:
        self.notify(f"requests sorted by {self.query_one(RowsPanel).cycle_sort()}", timeout=2)

    def _set_refresh(self, seconds: float) -> None:
        self.app.refresh_s = seconds
        self._timer.stop()
        self._timer = self.set_interval(seconds, self.tick)
        self.tick()
        self.notify(f"refreshing every {seconds:g} s", timeout=2)

    # ---- the tick -----------------------------------------------------------------------------------
    def status_text(self) -> str:
        return self.app.status_line() + (f"  · refresh {self.app.refresh_s:g} s") + ("  [PAUSED]" if self.paused else "")

    def tick(self) -> None:
        """Sample the engine's counters on every tick, in view or not, paused or not, so the rates window has
        no gap; redraw only while the screen is in view."""
        self.ticks += 1
        panel = self.query_one(ThroughputPanel)
        for index, server in enumerate(self.app.watched if self.app.attached else [self.app.server]):
            stats = None if server is None else server.host.stats()
            if stats is not None:  # an attached server's sample is timed when its snapshot came back
                self.rates_for(index).add(getattr(server.host, "fetched_at", None) or time.monotonic(), stats)
        panel.rates = self.rates_for(self.app.selected)
        if self.is_current:
            self.redraw(self.engine_stats())

    def rates_for(self, index: int) -> TokenRates:
        """Each watched server's own token rates, sampled every tick whichever is shown, so a tab switched to
        shows its rates at once."""
        return self._rates.setdefault(index, TokenRates())

    def on_screen_resume(self) -> None:
        if self._timer is not None:  # back in view: show what happened while away at once
            self.redraw(self.engine_stats())

    def engine_stats(self) -> EngineStats | None:
        """The selected server's snapshot; None before it has one (loading, or attached and not yet answered)."""
        server = self.app.server
        return None if server is None else server.host.stats()

    def redraw(self, stats: EngineStats | None) -> None:
        self.show_status()
        if self.paused:
            return
        # never another server's figures under this one's name: a server with no snapshot shows none
        blank = stats is None and self.app.server is not None
        self.query_one("#panels").display = not blank
        self.query_one("#no-snapshot", Static).display = blank
        if blank:
            self.query_one("#no-snapshot", Static).update(f"no snapshot from {self.app.server.url} yet; the "
                                                          "panels show it once it answers")
        if self.app.server is not None:
            self.query_one(EngineHeader).show(stats, self.app.server.url)
        if stats is None:
            return
        self.query_one(RowsPanel).show(stats)
        self.query_one(KVPanel).show(stats)
        self.query_one(ThroughputPanel).show(stats)
        self.query_one(ReadPanel).show(stats)
        self.query_one(RecentPanel).show(stats)
        off = []
        for panel in self.query(FeaturePanel):
            panel.show(stats)
            panel.display = panel.published
            if not panel.published and not isinstance(panel, ReplicasPanel):  # no replicas is not a switch off
                off.append(PANEL_TITLES[panel.id].lower())
        self.query_one("#features-off", Static).update(f"off: {', '.join(off)} (not published by this engine)"
                                                        if off else "")
