"""LiveFlags: the live flag changes (POST /knobs) made through the data-parallel front end, for a replica that
starts again later: it takes the flags the others have, not the history of how they got there.

Kept as the latest value of each flag with who set it, so it holds at most one entry per live flag however many
changes are made (a list of every change grew with each POST and was replayed in full on each restart).
"""

from __future__ import annotations


class LiveFlags:
    def __init__(self):
        self._latest: dict[str, tuple[object, str]] = {}  # flag -> (value, who), the last changed last

    def add(self, changes: dict, who: str) -> None:
        """Changes every replica took (so each name is a live flag: bounded by live_knobs.LIVE)."""
        for name, value in changes.items():
            self._latest.pop(name, None)
            self._latest[name] = (value, who)

    def replay(self) -> tuple[dict, str] | None:
        """(changes, who) that bring a fresh replica to the others' flags in one call, or None when none changed.
        One call with the final values: each step of the history was checked, and so was where it ended."""
        if not self._latest:
            return None
        whos = dict.fromkeys(who for _, who in self._latest.values())
        return {name: value for name, (value, _) in self._latest.items()}, f"{', '.join(whos)} (replayed on restart)"

    def __len__(self) -> int:
        return len(self._latest)
