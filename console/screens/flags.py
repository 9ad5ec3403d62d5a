"""The flags screen: a control for every engine flag, checked before it is applied, applied live or by a restart.

A change of live flags only (nanoserve/live_knobs.py; their help says "live") applies at the engine's next step
with no restart: on an attached server through its POST /knobs, with the API key the console was given.

The controls are generated from `EngineConfig.flag_specs()`, so a flag the engine gains shows up here with no
console change. Apply builds the whole new EngineConfig first (the engine's own checks refuse a bad value
with its message), asks for confirmation with the changes listed, then restarts the engine in a worker while
the screen lists each start-up phase as it begins.
"""

from __future__ import annotations

import dataclasses
import time

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static, Switch

from console import keys
from console.marked import MarkedCheckbox, MarkedSwitch
from console.screens.base import ConsoleScreen
from nanoserve.config import EngineConfig, FlagSpec
from nanoserve.live_knobs import LIVE, LOG_LEVELS, KnobChange, log_level

FIXED = {"model": "set at launch: nanoserve-console --model PATH"}  # flags a restart cannot change


def _shown(value) -> str:
    return "" if value is None else str(value)


class FlagControl:
    """Builds the widget for one flag and reads a value back from it."""

    def __init__(self, spec: FlagSpec):
        self.spec = spec
        self.widget_id = f"flag-{spec.name}"

    def build(self, value):
        spec = self.spec
        if spec.kind is bool:
            return MarkedSwitch(bool(value), self.widget_id)  # "on" / "off" beside it, not colour alone
        if spec.choices:
            return Select([(c, c) for c in spec.choices], value=value if value in spec.choices else spec.choices[0],
                          allow_blank=False, id=self.widget_id)
        return Input(_shown(value), placeholder="unset (decided at load)" if spec.optional else "",
                     id=self.widget_id)

    def read(self, widget):
        if isinstance(widget, (Switch, Select)):
            return widget.value
        return self.spec.parse(widget.value)

    def write(self, widget, value) -> None:
        if isinstance(widget, Input):
            widget.value = _shown(value)
        elif isinstance(widget, Select) and value not in self.spec.choices:
            widget.value = self.spec.choices[0]
        else:
            widget.value = value


class ConfirmRestart(ModalScreen[bool | None]):
    """Lists the changes and asks before the engine restarts. Its own "finish first" box starts as the form's
    and the line above it follows the box as it is toggled, so the dialog never says one thing while the box
    says another. Dismissed with the drain choice (True / False) on yes, None on cancel."""

    DEFAULT_CSS = """
    ConfirmRestart { align: center middle; }
    ConfirmRestart > Vertical { width: 72; max-width: 100%; height: auto; max-height: 100%; border: thick $warning;
                                background: $surface; padding: 1 2; }
    ConfirmRestart Horizontal { height: auto; margin-top: 1; }
    ConfirmRestart Button { margin-right: 2; }
    """
    BINDINGS = [Binding("escape,n", "answer(False)", "Cancel", id="confirm_no"),
                Binding("y", "answer(True)", "Restart", id="confirm_yes")]

    def __init__(self, changes: dict, drain: bool):
        super().__init__()
        self.changes, self.drain = changes, drain

    def compose(self) -> ComposeResult:
        lines = [f"  {name}: {_shown(old) or 'unset'} -> {_shown(new) or 'unset'}"
                 for name, (old, new) in self.changes.items()]
        with Vertical():
            yield Static("Restart the engine with these flags?\n\n" + "\n".join(lines), markup=False,
                         id="confirm-text")
            yield Static(then_text(self.drain), markup=False, id="confirm-then")
            yield MarkedCheckbox(DRAIN_LABEL, self.drain, id="confirm-drain")
            with Horizontal():
                yield Button("Restart (y)", variant="warning", id="confirm-yes")
                yield Button("Cancel (n)", id="confirm-no")

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        self.drain = event.value
        self.query_one("#confirm-then", Static).update(then_text(self.drain))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_answer(event.button.id == "confirm-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(self.drain if yes else None)


DRAIN_LABEL = "let running requests finish first"


def then_text(drain: bool) -> str:
    """What happens to the requests running when the restart starts, as the drain box says now."""
    return ("running requests finish first, then the engine restarts" if drain
            else "running requests are aborted when the engine restarts")


class FlagsScreen(ConsoleScreen):
    DEFAULT_CSS = """
    FlagsScreen #flags-form { grid-size: 3; grid-columns: 26 28 1fr; grid-rows: 3; height: auto; padding: 0 1; }
    FlagsScreen #flags-form Label { padding: 1 0 0 0; }
    FlagsScreen #flags-form .flag-help { color: $text-muted; padding: 1 0 0 1; }
    FlagsScreen #flags-actions, FlagsScreen #flags-ops { height: auto; padding: 1 1 0 1; }
    FlagsScreen #flags-ops Label { padding: 1 1 0 0; }
    FlagsScreen #flags-ops Select { width: 20; margin-right: 2; }
    FlagsScreen #flags-actions > * { margin-right: 2; }
    FlagsScreen #flags-message, FlagsScreen #flags-progress { padding: 0 1; height: auto; }
    """
    BINDINGS = [
        Binding(keys.APPLY, "apply", "Apply", id="flags_apply"),
        keys.reset("reset", "flags_reset"),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.controls = [FlagControl(spec) for spec in EngineConfig.flag_specs() if spec.name not in FIXED]
        self.restart_log: list[str] = []  # the phases of the latest restart, as shown
        self._tracking: dict | None = None  # the restart being followed: start time, last phase seen
        self._shown_from: str | None = None  # attached: the server whose published flags the form shows

    def compose_body(self) -> ComposeResult:
        config = self.app.config
        with VerticalScroll(can_focus=False):  # Tab goes to the first flag, not to the unlabelled scroll area
            with Grid(id="flags-form"):
                for name, why in FIXED.items():
                    yield Label(name)
                    yield Static(self.app.server.model_name if self.app.server else _shown(getattr(config, name)),
                                 markup=False, id=f"fixed-{name}")
                    yield Static(why, classes="flag-help", markup=False)
                for control in self.controls:
                    yield Label(control.spec.name)
                    yield control.build(getattr(config, control.spec.name))
                    live = "live (next step, no restart) · " if control.spec.name in LIVE else ""
                    yield Static(live + control.spec.help, classes="flag-help", markup=False)
            with Horizontal(id="flags-ops"):  # live operations, applied at once and logged
                yield Label("log level (live)")
                yield Select([(level.lower(), level) for level in LOG_LEVELS], value=log_level(), allow_blank=False,
                             id="ops-log-level")
                yield Button("Reset prefix cache", id="ops-reset-prefix")
            with Horizontal(id="flags-actions"):
                yield Button(keys.label("Apply", keys.APPLY), variant="primary", id="flags-apply-button")
                yield Button(keys.label("Reset", keys.RESET), id="flags-reset-button")
                yield MarkedCheckbox(DRAIN_LABEL, id="flags-drain")
            yield Static("", markup=False, id="flags-message")
            yield Static("", markup=False, id="flags-progress")

    def on_mount(self) -> None:
        self.every_while_shown(0.1, self.follow_restart)
        self.every_while_shown(self.app.refresh_s, self.show_decided)

    # ---- reading the form ---------------------------------------------------------------------------
    def proposed(self) -> EngineConfig:
        """The config the form describes; raises ValueError/ConfigError naming the bad flag."""
        values = {name: getattr(self.app.config, name) for name in FIXED}
        for control in self.controls:
            values[control.spec.name] = control.read(self.query_one(f"#{control.widget_id}"))
        return EngineConfig.from_flags(**values)

    def changes(self, new: EngineConfig) -> dict:
        old = self.app.config
        return {c.spec.name: (getattr(old, c.spec.name), getattr(new, c.spec.name)) for c in self.controls
                if getattr(old, c.spec.name) != getattr(new, c.spec.name)}

    def say(self, message: str) -> None:
        """The form's answer, below the buttons and as a toast, since the form is taller than most terminals."""
        line = self.query_one("#flags-message", Static)
        line.update(message)
        if message:
            line.scroll_visible(animate=False)
            failed = message.startswith(("not applied", "the new flags failed", "a restart is already"))
            self.notify(message, severity="error" if failed else "information", timeout=8)

    def show_decided(self) -> None:
        """An unset flag's placeholder shows what it came to at load (the engine's own numbers). Attached to a
        server elsewhere, the form shows the flags its snapshot publishes instead, as they are."""
        server = self.app.server
        if server is None:
            return
        if self.app.attached:
            self.show_attached(server)
            return
        try:
            decided = server.host.serving().resolved_at_load()
        except Exception:  # restarting: the next tick shows it
            return
        for control in self.controls:
            if control.spec.optional and control.spec.name in decided:
                widget = self.query_one(f"#{control.widget_id}", Input)
                widget.placeholder = f"unset: {decided[control.spec.name]} at load"

    def show_attached(self, server) -> None:
        stats = server.host.stats()
        if stats is None or self._shown_from == server.url:
            return
        self._shown_from = server.url
        self.query_one("#fixed-model", Static).update(server.model_name)
        for control in self.controls:
            if control.spec.name in stats.flags:
                control.write(self.query_one(f"#{control.widget_id}"), stats.flags[control.spec.name])
        level = self._log_level_shown()
        if level in LOG_LEVELS:
            self.query_one("#ops-log-level", Select).value = level
        self.query_one("#flags-message", Static).update(
            f"attached to {server.url}: these are the flags it publishes; they are set where it runs")

    # ---- actions ------------------------------------------------------------------------------------
    @on(Button.Pressed, "#flags-apply-button")
    def action_apply(self) -> None:
        if self.app.attached and self._apply_attached():
            return
        if self.app.attached:
            self.say(f"not applied: attached to {self.app.server.url if self.app.server else 'a server'}; its "
                     "flags are set where it runs (restart it there with the new flags)")
            return
        if self.app.restarting or self._tracking is not None:
            self.say("a restart is already running; wait for it to finish")
            return
        try:
            new = self.proposed()
        except Exception as e:  # ValueError from parsing, ConfigError from the engine's checks
            self.say(f"not applied: {e}")
            return
        changes = self.changes(new)
        if not changes:
            self.say("nothing to apply: the form matches the flags in force")
            return
        if set(changes) <= set(LIVE):
            self.run_worker(self._apply_live_here({name: new for name, (_, new) in changes.items()}))
            return
        self.say("")
        drain = self.query_one("#flags-drain", Checkbox).value

        def confirmed(drain: bool | None) -> None:
            if drain is None:
                self.say("not applied: cancelled")
                return
            self.query_one("#flags-drain", Checkbox).value = drain  # the form keeps the choice made in the dialog
            self.start_restart(new, drain)

        self.app.push_screen(ConfirmRestart(changes, drain), confirmed)

    # ---- live changes -------------------------------------------------------------------------------
    async def _apply_live_here(self, changes: dict) -> None:
        """Live flags into this console's engine, between two steps."""
        try:
            done = await self.app.server.host.set_live(changes, "console")
        except Exception as e:  # ConfigError: out of range, above what the engine started with
            self.say(f"not applied: {e}")
            return
        flags = {name: value for name, value in changes.items() if name in self.app.config.public()}
        self.app.config = dataclasses.replace(self.app.config, **flags)  # a later restart keeps them
        self.say(_applied(done))

    def _apply_attached(self) -> bool:
        """On an attached server, live flags only go through its POST /knobs; False for anything else."""
        server = self.app.server
        stats = server.host.stats() if server is not None else None
        if stats is None:
            return False
        try:
            values = {c.spec.name: c.read(self.query_one(f"#{c.widget_id}")) for c in self.controls}
        except ValueError as e:
            self.say(f"not applied: {e}")
            return True
        changes = {name: value for name, value in values.items() if name in stats.flags and stats.flags[name] != value}
        if not changes or not set(changes) <= set(LIVE):
            return False
        self.run_worker(lambda: self._post(server, "/knobs", changes), thread=True)
        return True

    # ---- live operations: the log level, the prefix cache ---------------------------------------------
    @on(Select.Changed, "#ops-log-level")
    def set_log_level(self, event: Select.Changed) -> None:
        """The engine's loggers' level, at once (the process's own when the engine runs here)."""
        server = self.app.server
        if server is None or event.value == self._log_level_shown():
            return
        if self.app.attached:
            self.run_worker(lambda: self._post(server, "/knobs", {"log_level": event.value}), thread=True)
        else:
            self.run_worker(self._apply_live_here({"log_level": event.value}))

    def _log_level_shown(self) -> str | None:
        """The level in force where the engine runs, as far as this screen knows (attached: its snapshot's)."""
        if not self.app.attached:
            return log_level()
        stats = self.app.server.host.stats()
        return None if stats is None else (stats.features.get("live") or {}).get("log_level")

    @on(Button.Pressed, "#ops-reset-prefix")
    def reset_prefix_cache(self) -> None:
        """Forget every cached block's name (running requests keep their blocks); logged with the knobs."""
        server = self.app.server
        if server is None:
            return
        if self.app.attached:
            self.run_worker(lambda: self._post(server, "/reset_prefix_cache", {}), thread=True)
        else:
            self.run_worker(self._reset_here())

    async def _reset_here(self) -> None:
        forgotten = await self.app.server.host.reset_prefix_cache("console")
        self.say(f"prefix cache reset: {forgotten} cached blocks forgotten; running requests keep theirs")

    def _post(self, server, route: str, body: dict) -> None:
        """An operation on an attached server, with the console's API key; the answer said on the screen."""
        import httpx

        try:
            r = httpx.post(f"{server.url}{route}", json=body, headers=server.headers, timeout=10)
            answer = r.json()
            if r.status_code != 200:
                message = f"not applied: {answer['error']['message']}"
            elif "changed" in answer:
                message = _applied([KnobChange(**c) for c in answer["changed"]]) + f" on {server.url}"
            else:
                message = f"prefix cache reset on {server.url}: {answer['blocks_forgotten']} cached blocks forgotten"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            message = f"not applied: {server.url} did not take it ({type(e).__name__}: {e})"
        self.app.call_from_thread(self.say, message)

    @on(Button.Pressed, "#flags-reset-button")
    def action_reset(self) -> None:
        """Put the flags in force back into the form."""
        if self.app.attached:
            self._shown_from = None
            self.show_decided()
        else:
            self.write_form()
        self.say("form reset to the flags in force")

    def write_form(self) -> None:
        for control in self.controls:
            control.write(self.query_one(f"#{control.widget_id}"), getattr(self.app.config, control.spec.name))

    # ---- the restart --------------------------------------------------------------------------------
    def start_restart(self, config: EngineConfig, drain: bool) -> None:
        track = {"started": time.monotonic(), "seen": len(self.app.phases), "restarts": self.app.restarts}
        try:
            self.app.restart_engine(config, drain=drain)
        except RuntimeError as e:
            self.say(f"not applied: {e}")
            return
        self.restart_log = []
        self._tracking = track

    def follow_restart(self) -> None:
        """List each phase as it begins; when the worker has ended, say how it went."""
        track = self._tracking
        if track is None:
            return
        done = self.app.restarts != track["restarts"]  # read first: the phases below then include the last
        new = self.app.phases[track["seen"]:]
        track["seen"] += len(new)
        for at, phase in new:
            self.restart_log.append(f"{at - track['started']:6.1f} s  {phase}")
        if new:
            progress = self.query_one("#flags-progress", Static)
            progress.update("restart:\n" + "\n".join(self.restart_log))
            progress.scroll_visible(animate=False)
        if not done:
            return
        elapsed = self.app.phases[-1][0] - track["started"]  # the restart's last phase: right even if seen late
        self._tracking = None
        error = self.app.restart_error
        self.write_form()
        if error is None:
            self.say(f"restarted in {elapsed:.1f} s; the flags above are in force")
        else:
            self.say(f"the new flags failed and the previous ones were restored: {error}")


def _applied(done: list) -> str:
    if not done:
        return "nothing changed: those values were in force"
    changed = ", ".join(f"{c.name} {_shown(c.old) or 'unset'} -> {_shown(c.new) or 'unset'}" for c in done)
    return f"applied live from step {done[0].step}: {changed}; no restart"
