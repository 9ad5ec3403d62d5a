"""--kv-events-config: vLLM's KV events over ZMQ, for the routers built around them (llm-d's precise prefix-cache
scorer, Dynamo, Ray Serve's KV-aware router).

The contract is vLLM's ZmqEventPublisher: a PUB socket bound to `endpoint`, each message three frames, the topic,
an 8-byte big-endian sequence number (from 0), and a msgpack KVEventBatch `[ts, [event, ...], data_parallel_rank]`
whose events are tagged arrays (kv/events.py). With `replay_endpoint`, a ROUTER socket answers a subscriber that
missed messages: it sends the first sequence number it wants (8 bytes), and gets every batch still kept (the last
`buffer_steps`) from there, each as [seq, payload], then [-1, b""]. Under data parallelism each replica binds its own
port: a tcp endpoint's port plus its rank, an ipc or inproc path with "_dp<rank>" (vLLM's offset_endpoint_port).

A step only queues its events (never blocks); one thread owns both sockets, encodes and sends. A full queue drops
the batch and counts it. The first message is an AllBlocksCleared, so a subscriber that followed an earlier
process at this endpoint starts over. Needs pyzmq and msgpack (the kv-events extra).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from nanoserve.errors import ConfigError
from nanoserve.kv.events import AllBlocksCleared

log = logging.getLogger("nanoserve.kv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The config from --kv-events-config's JSON; None when unset. ConfigError names what is wrong."""
        if text is None:
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--kv-events-config is not valid JSON ({e}); pass e.g. "
                              '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                              '"endpoint": "tcp://*:5557"}\'') from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config must be a JSON object of vLLM's KVEventsConfig fields")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config has no field {', '.join(unknown)}; its fields are "
                              f"{', '.join(known)}")
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("--kv-events-config: enable_kv_cache_events must be true or false")
        if self.publisher not in (None, "zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher {self.publisher!r} is not one nanoserve has; use "
                              '"zmq" (or "null" for none)')
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.topic, str):
            raise ConfigError("--kv-events-config: topic must be a string")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and
                                          re.match(r"^(tcp://[^:/]+:\d+|ipc://.+|inproc://.+)$", value)):
                raise ConfigError(f"--kv-events-config: {name} {value!r} is not a ZMQ endpoint; use "
                                  "tcp://HOST:PORT (tcp://*:5557 binds every interface), ipc://PATH or inproc://NAME")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel replica's own endpoint (vLLM's offset_endpoint_port)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        from nanoserve.optional import require

        self.zmq = require("zmq", "--kv-events-config")
        self.msgpack = require("msgpack", "--kv-events-config")
        self.config, self.rank = config, data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (offset_endpoint(config.replay_endpoint, data_parallel_rank)
                                if config.replay_endpoint else None)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self.batches = self.events = self.dropped = 0
        self._context = self.zmq.Context()
        self._pub = self._bind(self.zmq.PUB, self.endpoint)
        self._pub.set_hwm(config.hwm)
        self._replay = self._bind(self.zmq.ROUTER, self.replay_endpoint) if self.replay_endpoint else None
        self._warn_if_open()
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="nanoserve-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind, endpoint: str):
        socket = self._context.socket(kind)
        socket.setsockopt(self.zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except self.zmq.ZMQError as e:
            socket.close()
            self._context.term()
            raise ConfigError(f"--kv-events-config cannot bind {endpoint} ({e}); pick a free port (each "
                              "data-parallel replica takes the port plus its rank)") from None
        return socket

    def _warn_if_open(self) -> None:
        """The events carry every cached block's token ids (the prompts' text, in tokens) and ZMQ asks no key:
        said once at start when the socket is reachable from other machines, as vLLM's default tcp://*:5557 is."""
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint and endpoint.startswith("tcp://") and not endpoint.startswith(
                    ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")):
                log.warning("--kv-events-config publishes the token ids of every cached block on %s with no key "
                            "(the API key does not cover it): keep that port on a private network, or bind "
                            "tcp://127.0.0.1:PORT", endpoint)

    def publish(self, events: list) -> None:
        """Queue one step's events (called on the engine thread; never blocks)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("the KV event queue is full (%d batches): batches are being dropped; subscribers will "
                            "see a gap in the sequence numbers", self.config.max_queue_size)

    def stats(self) -> dict:
        return {"endpoint": self.endpoint, "batches": self.batches, "events": self.events,
                "dropped_batches": self.dropped}

    def _run(self) -> None:
        poller = self.zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self.zmq.POLLIN)
        while not self._stop.is_set() or not self._queue.empty():
            try:
                ts, events = self._queue.get(timeout=0.05)
                self._send(ts, events)
            except queue.Empty:
                pass
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def _send(self, ts: float, events: list) -> None:
        batch = [ts, [event.wire() for event in events], self.rank]
        payload = self.msgpack.packb(batch, use_bin_type=True)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([self.config.topic.encode(), seq.to_bytes(8, "big"), payload])
        self._kept.append((seq, payload))
        self.batches += 1
        self.events += len(events)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._kept):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_SEQ, b""])

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
