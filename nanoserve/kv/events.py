"""KV cache events, as vLLM publishes them for KV-aware routers: which block names the pool took in
(BlockStored), let go (BlockRemoved: evicted, or un-named when their step failed) or forgot all at once
(AllBlocksCleared: reset_prefix_cache).

The pool records into a KVEventLog only when someone listens (a None check otherwise). After each step the
engine's KVEventHub hands the step's events to its listeners: the ZMQ publisher of --kv-events-config
(kv/publisher.py) and a data-parallel replica's link to its front end (dp/replica.py). Consecutive blocks of one
chain named in one step travel as one BlockStored, as vLLM's do.

The records hold vLLM's required fields, in its order (vllm/distributed/kv_events.py); how they travel is the
publisher's business (kv/publisher.py). The block hashes are the pool's own 32-byte SHA-256 names (kv/prefix.py):
vLLM's ExternalBlockHash is bytes or int. `medium` is "GPU", vLLM's word for the engine's own KV pool, which its CPU
backend uses too. nanoserve has no LoRA, so `lora_id` and `lora_name` are always None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("nanoserve.kv")

MEDIUM = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the name of the block before the first one; None for a chain's first block
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MEDIUM


@dataclass
class AllBlocksCleared:
    pass


class KVEventLog:
    """What the pool did to its names since the last drain, in order."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list = []

    def stored(self, name: bytes, parent: bytes | None, tokens) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:  # the same chain, one block on
            last.block_hashes.append(name)
            last.token_ids.extend(tokens)
            return
        self._events.append(BlockStored([name], parent, list(tokens), self.block_size))

    def removed(self, name: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(name)
            return
        self._events.append(BlockRemoved([name]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def drain(self) -> list:
        events, self._events = self._events, []
        return events


class KVEventHub:
    """The engine's side: switches recording on for the first listener, and hands each step's events to every
    listener (on the engine thread; a listener that raises is logged and does not break the step)."""

    def __init__(self, kv_manager):
        self._kv = kv_manager
        self._log: KVEventLog | None = None
        self._listeners: list[Callable[[list], None]] = []

    def listen(self, listener: Callable[[list], None]) -> None:
        if self._log is None:
            self._log = KVEventLog(self._kv.block_size)
            self._kv.record_events(self._log)
        self._listeners.append(listener)

    def flush(self) -> None:
        """Hand what was recorded since the last flush to the listeners (nothing when nothing happened)."""
        if self._log is None:
            return
        events = self._log.drain()
        if not events:
            return
        for listener in self._listeners:
            try:
                listener(events)
            except Exception:
                log.exception("a KV event listener failed; the step goes on")
