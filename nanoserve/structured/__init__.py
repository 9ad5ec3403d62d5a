"""Structured outputs: constraints (params), their compiled grammars, and the per-step token mask."""
