"""The A/B screen: two flag sets over the flags in force, the same requests at both, a verdict per request.

A/A (its own key) runs the A flags on both arms: any difference there is the engine's noise, and the A/B verdict
line after it says so, since a difference the engine makes by itself is no evidence against a flag.

The run itself is `nanoserve.ab.ABRun` in a thread worker (it loads engines, which blocks); this screen
only reads its phase and counts on a timer, so nothing crosses threads but plain attribute reads, and Stop
is `ABRun.cancel()`, which hangs up the clients and stops whichever server is up.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Input, ProgressBar, Static
from textual.worker import Worker, WorkerState

from console import keys
from console.panels.ab_counters import ab_form, counter_cells
from console.screens.base import ConsoleScreen, positive_int
from nanoserve.ab import (
    DEFAULT_B,
    ABCancelled,
    ABResult,
    ABRun,
    ab_requests,
    snippet,
    variant,
)
from nanoserve.workload import pick_prompts

SNIPPET = 30  # characters of each text in a verdict row: the table fits 100 columns

# input id -> (border title, default value, placeholder)
FIELDS = {
    "flags-a": ("A flags", "", "the flags in force, e.g. max_num_seqs=8"),
    "flags-b": ("B flags", DEFAULT_B, "overrides on top of the flags in force"),
    "num-prompts": ("prompts", "8", "requests"),
    "max-tokens": ("max tokens", "32", "per request"),
    "concurrency": ("concurrency", "6", "clients at once"),
}


class ABScreen(ConsoleScreen):
    """State tests read: `ab` (the ABRun, None before the first), `running`, `result`, `verdicts`, `error`."""

    AUTO_FOCUS = "#run"
    BINDINGS = [
        keys.run("run_ab", "ab_run"),
        Binding(keys.AA, "run_aa", "A/A", id="ab_aa"),
        keys.stop("stop_ab", "ab_stop"),
    ]
    DEFAULT_CSS = """
    ABScreen #ab-form, ABScreen #ab-flags, ABScreen #ab-numbers { height: auto; }
    ABScreen #ab-form Input { width: 18; border-title-color: $accent; }
    ABScreen #ab-form #flags-a, ABScreen #ab-form #flags-b { width: 1fr; }  /* a line of their own: flag sets are long */
    ABScreen #ab-form Button { margin: 0 0 0 1; min-width: 8; }
    ABScreen #ab-progress-line { height: auto; padding: 0 1; }
    ABScreen #ab-progress { width: 50; }
    ABScreen #ab-phase { width: 1fr; height: auto; color: $text-muted; }  /* wraps: never cut at the edge */
    ABScreen #ab-summary { height: auto; max-height: 8; overflow-y: auto; padding: 0 1; text-style: bold; }
    ABScreen #ab-summary.refused { color: $error; }
    ABScreen #ab-tables { height: 1fr; min-height: 8; }
    ABScreen #ab-tables DataTable { border: round $primary; border-title-color: $accent; height: 1fr; width: 1fr; }
    /* narrow: the tables one above the other, each the full width, so the counters' A, B and diff all show */
    ABScreen.-narrow #ab-tables { layout: vertical; }
    ABScreen.-narrow #ab-progress { width: 30; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ab: ABRun | None = None
        self.running = False
        self.result: ABResult | None = None
        self.verdicts: list = []
        self.error: str | None = None  # why the last Run was refused or failed
        self.aa_results: dict[str, ABResult] = {}  # repr(A config) -> its last A/A run

    def compose_body(self) -> ComposeResult:
        with Vertical(id="ab-form"):
            with Horizontal(id="ab-flags"):
                for field_id, (_, value, placeholder) in FIELDS.items():
                    if field_id.startswith("flags"):
                        yield Input(value, placeholder=placeholder, id=field_id)
            with Horizontal(id="ab-numbers"):
                for field_id, (_, value, placeholder) in FIELDS.items():
                    if not field_id.startswith("flags"):
                        yield Input(value, placeholder=placeholder, type="integer", id=field_id)
                yield Button(keys.label("Run", keys.RUN), id="run", variant="primary")
                yield Button(keys.label("A/A", keys.AA), id="run-aa")
                yield Button(keys.label("Stop", keys.STOP), id="stop", variant="error", disabled=True)
        with Horizontal(id="ab-progress-line"):
            yield ProgressBar(total=1, id="ab-progress", show_eta=False)  # determinate: an idle bar never animates
            yield Static(f"set two flag sets and press {keys.RUN} to run ({keys.AA}: A/A, the A flags on both arms)",
                         markup=False, id="ab-phase")
        yield Static("", markup=False, id="ab-summary")
        with Horizontal(id="ab-tables"):
            yield DataTable(id="verdicts", zebra_stripes=True, cursor_type="row")
            yield DataTable(id="counters", zebra_stripes=True, cursor_type="row")

    def on_mount(self) -> None:
        for field_id, (title, _, _) in FIELDS.items():
            self.query_one(f"#{field_id}").border_title = title
        self.query_one("#verdicts").border_title = "Verdicts (A vs B, byte for byte)"
        self.query_one("#counters").border_title = "Counters"
        self.query_one("#verdicts", DataTable).add_columns("#", "kind", "verdict", "A text", "B text")
        self.query_one("#counters", DataTable).add_columns("counter", "A", "B", "B vs A")

    def on_unmount(self) -> None:
        if self.ab is not None:  # the app is closing: take down whatever the run has up
            self.ab.cancel()

    # ---- actions ------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Run while idle, Stop while running (None: the footer greys the other out)."""
        if action not in ("run_ab", "run_aa", "stop_ab"):
            return super().check_action(action, parameters)
        return {"run_ab": not self.running, "run_aa": not self.running, "stop_ab": self.running}[action] or None

    @on(Button.Pressed, "#run")
    @on(Input.Submitted)
    def action_run_ab(self) -> None:
        self.start(aa=False)

    @on(Button.Pressed, "#run-aa")
    def action_run_aa(self) -> None:
        self.start(aa=True)

    def start(self, aa: bool) -> None:
        """Run A against B, or (`aa`) A against itself."""
        if self.running:
            return
        self.clear_result()  # a refusal too: the previous run's verdict must not stand under it
        try:
            side = "A flags"
            config_a = variant(self.app.config, self.query_one("#flags-a", Input).value)
            side = "B flags"
            config_b = config_a if aa else variant(self.app.config, self.query_one("#flags-b", Input).value)
            side = ""
            num_prompts, max_tokens, concurrency = map(self.count, ("num-prompts", "max-tokens", "concurrency"))
        except ValueError as e:  # ConfigError is a ValueError too
            self.refuse(f"{side}: {ab_form(str(e))}" if side else str(e))
            return
        self.ab = ABRun(config_a, config_b, ab_requests(pick_prompts(num_prompts), max_tokens), concurrency,
                        progress=self.post_progress)
        self.set_running(True)
        self.run_worker(self.ab.run, thread=True, name="ab", group="ab", exit_on_error=False)

    @on(Button.Pressed, "#stop")
    def action_stop_ab(self) -> None:
        if self.running and self.ab is not None:
            self.ab.cancel()
            self.query_one("#ab-phase", Static).update(f"stopping ({self.ab.phase})…")

    def count(self, field_id: str) -> int:
        return positive_int(self.query_one(f"#{field_id}", Input), FIELDS[field_id][0])

    def clear_result(self) -> None:
        self.error, self.result, self.verdicts = None, None, []
        self.query_one("#verdicts", DataTable).clear()
        self.query_one("#counters", DataTable).clear()
        summary = self.query_one("#ab-summary", Static)
        summary.update("")
        summary.remove_class("refused")
        summary.styles.color = None

    def refuse(self, message: str) -> None:
        """Why Run did nothing, whole (the summary line wraps; the phase line is one line high)."""
        self.error = message
        self.query_one("#ab-phase", Static).update("not started: the reason is below")
        summary = self.query_one("#ab-summary", Static)
        summary.update(f"not started: {message}")
        summary.add_class("refused")
        self.notify(message, title="A/B not started", severity="error")

    def set_running(self, running: bool) -> None:
        """Enable the button that applies and focus it (a disabled button would pass focus to an input, where
        the r and s keys would be typed rather than bound)."""
        self.running = running
        run, stop = self.query_one("#run", Button), self.query_one("#stop", Button)
        wanted, other = (stop, run) if running else (run, stop)
        wanted.disabled, other.disabled = False, True
        self.query_one("#run-aa", Button).disabled = running
        wanted.focus()
        self.refresh_bindings()

    # ---- the run ------------------------------------------------------------------------------------
    class Progress(Message):
        """The run's worker thread says where it is: its phase, and requests answered of all."""

        def __init__(self, phase: str, done: int, total: int):
            super().__init__()
            self.phase, self.done, self.total = phase, done, total

    def post_progress(self, phase: str, done: int, total: int) -> None:
        """The run's progress callback, called on its worker thread: posted, not written into the screen."""
        self.post_message(self.Progress(phase, done, total))

    def on_abscreen_progress(self, message: Progress) -> None:
        if not self.running:  # a late message from a run that has ended
            return
        self.query_one("#ab-progress", ProgressBar).update(total=message.total, progress=message.done)
        self.query_one("#ab-phase", Static).update(f"{message.phase}… {message.done}/{message.total} requests "
                                                   "answered")

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "ab" or not event.worker.is_finished:
            return
        self.set_running(False)
        phase = self.query_one("#ab-phase", Static)
        if event.state == WorkerState.SUCCESS:
            self.show_result(event.worker.result)
            phase.update(f"done: {self.ab.total} requests answered, both servers stopped")
        elif isinstance(event.worker.error, ABCancelled):
            phase.update(f"stopped ({self.ab.phase}); every server the run started is down")
        elif event.state == WorkerState.ERROR:
            self.error = f"{type(event.worker.error).__name__}: {event.worker.error}"
            phase.update(f"failed: {self.error}")

    def show_result(self, result: ABResult) -> None:
        self.result, self.verdicts = result, result.verdicts
        self.query_one("#ab-progress", ProgressBar).update(total=self.ab.total, progress=self.ab.done)
        verdicts = self.query_one("#verdicts", DataTable)
        for v in result.verdicts:
            style = "green" if v.identical else "bold red"
            verdicts.add_row(Text(str(v.index)), Text(v.kind), Text(v.label, style=style),
                             Text(snippet(v.text_a, SNIPPET)), Text(snippet(v.text_b, SNIPPET)), key=str(v.index))
        counters = self.query_one("#counters", DataTable)
        for (name, *_), cells in zip(result.counter_rows(), counter_cells(result.counter_rows())):
            counters.add_row(*(Text(c) for c in cells), key=name)
        key = repr(result.a.config)
        if result.same_arms:
            self.aa_results[key] = result
        summary = self.query_one("#ab-summary", Static)
        summary.update(result.summary(aa=None if result.same_arms else self.aa_results.get(key)))
        summary.styles.color = "green" if result.all_identical and result.crowded else "red"
