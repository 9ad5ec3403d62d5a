"""Small helpers shared by tests that watch a live engine thread or server, or read what a step wrote."""

from __future__ import annotations

import time
from contextlib import contextmanager

TINY_SERVE = dict(max_model_len=128, kv_cache_gib=0.01)  # a tiny checkpoint's server: short context, small pool


@contextmanager
def tiny_server_running(checkpoint, engine_flags: dict | None = None, **server_options):
    """A live server on loopback over `checkpoint`, served as "tiny", with `engine_flags` beyond TINY_SERVE and
    Server's `server_options`."""
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    config = EngineConfig(model=str(checkpoint), **{**TINY_SERVE, **(engine_flags or {})})
    s = Server(config, port=0, served_model_name="tiny", **server_options).start()
    try:
        yield s
    finally:
        s.stop()


def wait_until(predicate, timeout: float = 10.0, every: float = 0.02) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; tests assert on the result instead of sleeping."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def counters(result) -> dict:
    """An A/B result's counters by name: {name: (A's value, B's value)}."""
    return {name: (a, b) for name, a, b in result.counter_rows()}


def cells_changed(now, before, layout: str = "slots", keys: bool = False) -> set[tuple[int, int, int]]:
    """(layer, block, offset) of every KV-cache cell where `now` differs from `before`: both
    [layers, blocks, block_size, kv_heads, head_dim] (KVCache layout "slots") or
    [layers, kv_heads, blocks, block_size, head_dim] ("heads", the batch-invariant engine's, and the V of
    "heads_kt"); the K of "heads_kt" (`keys`) is [layers, kv_heads, blocks, head_dim, block_size]."""
    changed = now != before
    if layout == "slots":
        changed = changed.flatten(3).any(-1)
    elif layout == "heads_kt" and keys:
        changed = changed.any(-2).any(1)
    else:
        changed = changed.any(-1).any(1)
    return {tuple(cell) for cell in changed.nonzero().tolist()}


def decode_step_cells(requests, block_size: int, padded: bool, layers: int) -> set[tuple[int, int, int]]:
    """The cells one decode-only step writes, read off its requests after the step: each row's newest token
    (position num_computed - 1) in its own block, plus slot 0 of the null block when the step had padded rows."""
    cells = {(r.blocks[(r.num_computed - 1) // block_size], (r.num_computed - 1) % block_size) for r in requests}
    if padded:
        cells.add((0, 0))
    return {(layer, block, offset) for layer in range(layers) for block, offset in cells}
