"""On/off controls that say their state in text, not by colour alone (a colour-blind reader, a monochrome SSH
terminal and a screen reader all see it)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Checkbox, Static, Switch


def on_off(value: bool) -> str:
    return "on" if value else "off"


class MarkedCheckbox(Checkbox):
    """A checkbox whose box holds an X when checked and is empty when not: [X] / [ ]."""

    @property
    def BUTTON_INNER(self) -> str:  # noqa: N802 (ToggleButton's class attribute, read per render)
        return "X" if self.value else " "


class MarkedSwitch(Horizontal):
    """A Switch (id `switch_id`, so forms query it as before) with "on" / "off" written beside it."""

    DEFAULT_CSS = """
    MarkedSwitch { height: auto; width: auto; }
    MarkedSwitch .switch-state { width: 4; padding: 1 0 0 1; }
    """

    def __init__(self, value: bool, switch_id: str):
        super().__init__(classes="marked-switch")
        self.value, self.switch_id = value, switch_id

    def compose(self) -> ComposeResult:
        yield Switch(value=self.value, id=self.switch_id)
        yield Static(on_off(self.value), markup=False, classes="switch-state")

    def on_switch_changed(self, event: Switch.Changed) -> None:
        self.query_one(".switch-state", Static).update(on_off(event.value))
