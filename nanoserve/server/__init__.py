"""Serving: the engine host (engine loop in its own thread) and, on top of it, the HTTP API."""
