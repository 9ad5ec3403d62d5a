"""EngineLog: the `nanoserve` loggers' records, kept for the log screen instead of written over the terminal."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import islice

KEEP = 2000  # lines kept; older ones drop off


class EngineLog(logging.Handler):
    """A logging handler and a bounded, numbered line buffer any thread may append to."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
        self._lines: deque[tuple[int, str]] = deque(maxlen=KEEP)
        self._count = 0
        self._guard = threading.Lock()
        self._saved: tuple[int, bool] | None = None

    def attach(self, name: str = "nanoserve") -> None:
        """Route the engine's loggers here (and not to stderr, which the terminal UI owns)."""
        logger = logging.getLogger(name)
        self._saved = (logger.level, logger.propagate)
        logger.addHandler(self)
        logger.setLevel(min(logger.getEffectiveLevel(), self.level))
        logger.propagate = False

    def detach(self, name: str = "nanoserve") -> None:
        logger = logging.getLogger(name)
        logger.removeHandler(self)
        if self._saved is not None:
            logger.setLevel(self._saved[0])
            logger.propagate = self._saved[1]
            self._saved = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._append(self.format(record))
        except Exception:
            self.handleError(record)

    def note(self, message: str) -> None:
        """A console line of its own (a phase change, a restart), timestamped like the log records."""
        self._append(f"{time.strftime('%H:%M:%S')} CONSOLE {message}")

    def _append(self, line: str) -> None:
        with self._guard:
            self._count += 1
            self._lines.append((self._count, line))

    def since(self, seen: int) -> tuple[int, list[str]]:
        """Lines numbered after `seen`, and the newest number (pass it back next time)."""
        with self._guard:
            new = min(self._count - seen, len(self._lines))  # more new lines than kept: the kept ones
            if new <= 0:
                return self._count, []
            lines = [line for _, line in islice(reversed(self._lines), new)]  # only the new ones, newest first
            count = self._count
        lines.reverse()
        return count, lines
