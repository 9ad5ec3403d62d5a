"""Attention paths. `invariant` is the batch-invariant one: every query, decode row or prefill token, computed
the same way, so a row's numbers depend only on its own tokens (see invariant.py)."""
