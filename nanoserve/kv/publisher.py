"""--kv-events-config: vLLM's KV events over ZMQ, for the routers built around them (llm-d's precise prefix-cache
scorer, Dynamo, Ray Serve's KV-aware router).

The contract is vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py): a PUB socket at `endpoint`, bound when
the endpoint is a wildcard ("*" or "::") or ipc/inproc and connected otherwise (tcp://router-host:5557 reaches a
router that binds its SUB socket, as llm-d's does). One difference, since the events carry every cached prompt's
token ids and ZMQ asks no key: vLLM's default `tcp://*:PORT` binds loopback here (127.0.0.1:PORT), as the HTTP
server does by default; an address named explicitly binds as asked (tcp://0.0.0.0:PORT, every interface, which
vLLM would connect to), with a warning. Each message is three frames: the topic, an 8-byte big-endian
sequence number (from 0), and a msgpack KVEventBatch `[ts, [event, ...], data_parallel_rank]`. Each event is what
msgspec writes for vLLM's tag=True structs: a map {"type": "BlockStored", "block_hashes": ..., ...} since vLLM 0.26
(wire_format "map", the default), or a tagged array ["BlockStored", ...] as older vLLM sent (wire_format "array",
nanoserve's one key beyond vLLM's, for routers that predate the change). With `replay_endpoint`, a ROUTER socket
answers a subscriber that missed messages: it sends the first sequence number it wants (8 bytes) and gets every
batch still kept (the last `buffer_steps`) from there, each as [topic, seq, payload], then [b"", -1, b""] (with
wire_format "array": [seq, payload], then [-1, b""], as older vLLM answered). Under data parallelism each replica
has its own endpoint: a tcp endpoint's port plus its rank, an inproc (or ipc: vLLM refuses those) path with
"_dp<rank>" (vLLM's offset_endpoint_port).

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
WILDCARD = "tcp://*:"  # vLLM's default endpoint's form: bound on LOOPBACK here unless an address is named
LOOPBACK = "127.0.0.1"
WIRE_FORMATS = ("map", "array")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field, and wire_format (see the module's docstring)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    wire_format: str = "map"

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
        if self.wire_format not in WIRE_FORMATS:
            raise ConfigError(f"--kv-events-config: wire_format {self.wire_format!r} is not one nanoserve has; use "
                              '"map" (vLLM 0.26 and later) or "array" (the tagged arrays of older vLLM)')
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and re.match(
                    r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d+|ipc://.+|inproc://.+)$", value)):
                raise ConfigError(f"--kv-events-config: {name} {value!r} is not a ZMQ endpoint; use tcp://*:PORT "
                                  "(binds every interface), tcp://HOST:PORT (connects to a subscriber that binds), "
                                  "ipc://PATH or inproc://NAME")


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` or connects to it: vLLM's rule (bind a wildcard, ipc or inproc),
    and 0.0.0.0, every interface, which names no host a connection could reach."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", "tcp://0.0.0.0:"))


def bound_address(endpoint: str) -> str:
    """Where a bound `endpoint` listens: vLLM's default wildcard `tcp://*:PORT` on loopback only, since it names
    no address and the events it would spread to every interface carry every prompt's token ids with no key;
    any other endpoint as written."""
    return f"tcp://{LOOPBACK}:{endpoint[len(WILDCARD):]}" if endpoint.startswith(WILDCARD) else endpoint


def wire(event, wire_format: str = "map"):
    """One event as msgspec writes vLLM's tag=True struct: a map led by its "type" (vLLM 0.26 and later), or with
    wire_format "array" the tagged array of older vLLM. Every field the records hold is one vLLM requires, so none is
    left out (msgspec's omit_defaults drops only fields with defaults)."""
    tag, names = type(event).__name__, [f.name for f in fields(event)]
    if wire_format == "array":
        return [tag, *(getattr(event, name) for name in names)]
    return {"type": tag, **{name: getattr(event, name) for name in names}}


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel replica's own endpoint (vLLM's offset_endpoint_port)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def batch_payload(msgpack, ts: float, events: list, rank: int, wire_format: str = "map") -> bytes:
    """A KVEventBatch as msgspec writes vLLM's (an array_like struct: [ts, events, data_parallel_rank])."""
    return msgpack.packb([ts, [wire(event, wire_format) for event in events], rank], use_bin_type=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        from nanoserve.optional import require

        self.zmq = require("zmq", "--kv-events-config")
        self.msgpack = require("msgpack", "--kv-events-config")
        self.config, self.rank = config, data_parallel_rank
        self._pub = None
        asked = offset_endpoint(config.endpoint, data_parallel_rank)
        replay = offset_endpoint(config.replay_endpoint, data_parallel_rank) if config.replay_endpoint else None
        self.binds = binds(asked)
        self.endpoint = bound_address(asked) if self.binds else asked
        self.replay_endpoint = bound_address(replay) if replay else None
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self.batches = self.events = self.dropped = 0
        self._context = self.zmq.Context()
        self._pub = self._open(self.zmq.PUB, self.endpoint, self.binds, config.hwm)
        self._replay = (self._open(self.zmq.ROUTER, self.replay_endpoint, True) if self.replay_endpoint else None)
        self._say_where((asked, self.endpoint, self.binds), (replay, self.replay_endpoint, True))
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="nanoserve-kv-events", daemon=True)
        self._thread.start()

    def _open(self, kind, endpoint: str, bind: bool, hwm: int | None = None):
        socket = self._context.socket(kind)
        socket.setsockopt(self.zmq.LINGER, 0)
        if hwm is not None:
            socket.set_hwm(hwm)
        if endpoint.startswith("tcp://["):
            socket.setsockopt(self.zmq.IPV6, 1)
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except self.zmq.ZMQError as e:
            socket.close()
            if self._pub is not None:
                self._pub.close()
            self._context.term()
            if not bind:
                raise ConfigError(f"--kv-events-config cannot connect to {endpoint} ({e}); name the subscriber's "
                                  "host and port, or bind with tcp://*:PORT") from None
            raise ConfigError(f"--kv-events-config cannot bind {endpoint} ({e}); pick a free port (each "
                              "data-parallel replica takes the port plus its rank)") from None
        return socket

    def _say_where(self, *sockets: tuple[str | None, str | None, bool]) -> None:
        """The events carry every cached block's token ids (the prompts' text, in tokens) and ZMQ asks no key, so
        the start-up log says where each socket it binds listens: on loopback, when vLLM's wildcard was narrowed
        to it, with how to publish further; reachable from other machines, as a warning. (A connecting PUB socket
        sends only to the subscriber it names.)"""
        for asked, endpoint, bound in sockets:
            if not (endpoint and bound and endpoint.startswith("tcp://")):
                continue
            if endpoint != asked:
                port = endpoint.rsplit(":", 1)[1]
                log.warning("--kv-events-config: %s (vLLM's default wildcard) publishes on %s, loopback only: the "
                            "events carry every cached prompt's token ids with no key (the API key does not cover "
                            "them); to publish on every interface name it: tcp://0.0.0.0:%s, on a private network",
                            asked, endpoint, port)
            elif not endpoint.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:")):
                log.warning("--kv-events-config publishes the token ids of every cached block on %s with no key "
                            "(the API key does not cover it): keep that port on a private network, or publish on "
                            "ipc://PATH or to a subscriber that binds (tcp://HOST:PORT)", endpoint)

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
        payload = batch_payload(self.msgpack, ts, events, self.rank, self.config.wire_format)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([self.config.topic.encode(), seq.to_bytes(8, "big"), payload])
        self._kept.append((seq, payload))
        self.batches += 1
        self.events += len(events)

    def _answer_replay(self) -> None:
        """vLLM's replay answer; with wire_format "array", without the topic frames, as older vLLM answered."""
        frames = self._replay.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        topic = [] if self.config.wire_format == "array" else [self.config.topic.encode()]
        for seq, payload in list(self._kept):
            if seq >= start:
                self._replay.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", *[b"" for _ in topic], END_SEQ, b""])

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
