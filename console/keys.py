"""The keys every screen shares for the same kind of action, so run, stop and reset are one key each.

They are control keys that a text field does not take (Textual's Input keeps ctrl+x for cut, ctrl+u/k/w for
deletes, ctrl+a/e for home and end), so they work while a field has the focus too.
"""

from __future__ import annotations

from textual.binding import Binding

RUN = "ctrl+r"  # start a load run, an A/B run
STOP = "ctrl+b"  # stop what runs: a load run, an A/B run, a streaming answer
AA = "ctrl+t"  # the A/B screen's A/A check: the A flags on both arms
RESET = "ctrl+n"  # back to the start: the flags form, a new chat
APPLY = "ctrl+s"  # apply the flags form (a restart)


def run(action: str, id: str, description: str = "Run") -> Binding:
    return Binding(RUN, action, description, id=id)


def stop(action: str, id: str, description: str = "Stop") -> Binding:
    return Binding(STOP, action, description, id=id)


def reset(action: str, id: str, description: str = "Reset") -> Binding:
    return Binding(RESET, action, description, id=id)


def label(text: str, key: str) -> str:
    """A button's text with its key: 'Run  ctrl+r'."""
    return f"{text}  {key}"
