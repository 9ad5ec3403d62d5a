"""Placeholder while this screen is written."""

from __future__ import annotations

from console.screens.base import ConsoleScreen


class LoadScreen(ConsoleScreen):
    pass
