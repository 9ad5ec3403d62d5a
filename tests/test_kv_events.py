"""--kv-events-config: vLLM's KV events over ZMQ, read back by a subscriber written as vLLM's example is (pyzmq,
and msgspec decoding into vLLM's own struct definitions, current and older): the block set it rebuilds is the pool's
own, and each payload is byte for byte what msgspec writes for vLLM's structs."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError
from nanoserve.kv import events as records
from nanoserve.kv.events import KVEventLog
from nanoserve.kv.publisher import KVEventsConfig, batch_payload, binds, offset_endpoint

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


# ---- vLLM's types (vllm/distributed/kv_events.py), as its example subscriber copies them -------------------------
# Current vLLM (0.26 and later): the batch an array, each event a map led by its "type" (extra_keys' typed union is
# left as Any: nanoserve never sends it).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# Older vLLM (wire_format "array"): every event a tagged array, as its example subscriber long copied them.
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """vLLM's example subscriber: SUB on the topic, decode each batch, keep the block set. With bind=True it binds
    and the engine's PUB socket connects to it (an endpoint without a wildcard), as llm-d's router does."""

    def __init__(self, endpoint: str, topic: str, batch_type=KVEventBatch, bind: bool = False):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.bind(endpoint) if bind else self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.decoder = msgspec.msgpack.Decoder(type=batch_type)
        self.topics: set[bytes] = set()
        self.blocks: set = set()
        self.seqs: list[int] = []
        self.ranks: set = set()
        self.kinds: list[str] = []

    def drain(self, idle_ms: int = 500) -> None:
        while self.sub.poll(idle_ms):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = self.decoder.decode(payload)
            self.ranks.add(batch.data_parallel_rank)
            for event in batch.events:
                kind = type(event).__name__.removeprefix("Array")
                self.kinds.append(kind)
                if kind == "BlockStored":
                    assert event.block_size == 16 and len(event.token_ids) == 16 * len(event.block_hashes)
                    assert all(len(h) == 32 for h in event.block_hashes) and event.medium == "GPU"
                    self.blocks.update(event.block_hashes)
                elif kind == "BlockRemoved":
                    self.blocks.difference_update(event.block_hashes)
                else:
                    self.blocks.clear()

    def close(self) -> None:
        self.sub.close()
        self.context.term()


@pytest.fixture
def publishing_llm(tiny_checkpoint):
    port = _free_port() - 1  # rank 1 binds the port after it
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "topic": "kv-events"}
    from tests.test_engine_crowd import BLOCK_BYTES

    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=16 * BLOCK_BYTES / 2**30,
              kv_events_config=json.dumps(config), data_parallel_rank=1)  # 16 blocks: the prompts evict
    yield llm, port + 1
    llm.engine.close()


def test_a_subscriber_rebuilds_the_pools_block_set(publishing_llm):
    llm, port = publishing_llm
    assert llm.engine.kv_publisher.endpoint == f"tcp://127.0.0.1:{port}"  # the port offset by the rank
    sub = Subscriber(f"tcp://127.0.0.1:{port}", "kv-events")
    try:
        time.sleep(0.3)  # a SUB socket hears only what is sent after it has joined
        shared = list(range(200, 248))  # three full blocks every prompt starts with
        prompts = [{"prompt_token_ids": shared + [300 + i] * (20 + i)} for i in range(12)]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for chunk in (prompts[:4], prompts[4:8], prompts[8:]):  # a small pool: later prompts evict earlier blocks
            llm.generate(chunk, params, use_tqdm=False)
        sub.drain()
        pool = llm.engine.kv.named_blocks()
        stats = llm.engine.stats().prefix_cache
        assert stats.evictions > 0 and "BlockRemoved" in sub.kinds
        assert sub.blocks == pool and len(pool) > 0
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap
        assert sub.ranks == {1} and sub.topics == {b"kv-events"}
        published = llm.engine.stats().features["kv_events"]
        assert published["dropped_batches"] == 0 and published["events"] >= len(sub.kinds)

        llm.engine.reset_prefix_cache("test")
        sub.drain()
        assert sub.kinds[-1] == "AllBlocksCleared" and sub.blocks == set() == llm.engine.kv.named_blocks()
    finally:
        sub.close()


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_a_late_subscriber_catches_up_through_the_replay_socket(tiny_checkpoint, wire_format):
    """vLLM's replay answer: [topic, seq, payload] per batch kept, then [b"", -1, b""]; older vLLM's (wire_format
    "array") has no topic frames."""
    port, replay_port = _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc:///tmp/nanoserve-kv-{port}", "topic": "t",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "buffer_steps": 1000, "wire_format": wire_format}
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01,
              kv_events_config=json.dumps(config))
    try:
        llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
        context = zmq.Context()
        replay = context.socket(zmq.DEALER)  # a REQ socket would take the first answer only
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch if wire_format == "map" else ArrayKVEventBatch)
        seqs, blocks = [], set()
        while True:
            if not replay.poll(5000):
                raise AssertionError("no replay answer")
            frames = replay.recv_multipart()[1:]  # the empty delimiter first
            assert len(frames) == (3 if wire_format == "map" else 2)
            *topic, seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b"" and topic in ([b""], [])
                break
            assert topic in ([b"t"], [])
            seqs.append(int.from_bytes(seq, "big"))
            for event in decoder.decode(payload).events:
                if type(event).__name__.endswith("BlockStored"):
                    blocks.update(event.block_hashes)
        replay.close()
        context.term()
        assert seqs[0] == 0 and seqs == list(range(len(seqs)))
        assert blocks == llm.engine.kv.named_blocks() and blocks
    finally:
        llm.engine.close()


def test_an_endpoint_without_a_wildcard_connects_to_a_subscriber_that_binds(tiny_checkpoint):
    """vLLM's rule: tcp://HOST:PORT connects (a router such as llm-d's binds its SUB socket); older vLLM's tagged
    arrays decode with its older structs."""
    port = _free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", "", ArrayKVEventBatch, bind=True)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "wire_format": "array"}
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01,
              kv_events_config=json.dumps(config))
    try:
        sub.drain(300)  # a bound SUB socket sends its subscription to a new peer only while it is being polled
        llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
        sub.drain()
        assert "BlockStored" in sub.kinds and sub.blocks == llm.engine.kv.named_blocks() and sub.ranks == {0}
    finally:
        llm.engine.close()
        sub.close()


@pytest.mark.parametrize("wire_format, batch_type", [("map", KVEventBatch), ("array", ArrayKVEventBatch)])
def test_a_payload_is_what_msgspec_writes_for_vllms_structs(wire_format, batch_type):
    import msgpack

    names = [bytes([i]) * 32 for i in range(3)]
    ours = [records.AllBlocksCleared(), records.BlockStored(names[:2], None, list(range(32)), 16),
            records.BlockStored(names[2:], names[1], list(range(16)), 16), records.BlockRemoved(names[:1])]
    payload = batch_payload(msgpack, 1234.5, ours, 3, wire_format)
    decoded = msgspec.msgpack.decode(payload, type=batch_type)
    assert decoded.data_parallel_rank == 3 and decoded.ts == 1234.5
    assert [type(e).__name__.removeprefix("Array") for e in decoded.events] == [
        "AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]
    stored = decoded.events[2]
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        names[2:], names[1], list(range(16)), 16)
    assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
    if wire_format == "map":  # byte for byte what vLLM writes: key order, tags, nothing extra or missing
        assert msgspec.msgpack.encode(decoded) == payload
    else:  # msgspec writes an array_like struct's defaults too; the tagged array holds vLLM's required fields
        assert msgpack.unpackb(payload)[1][1][:1] == ["BlockStored"] and len(msgpack.unpackb(payload)[1][1]) == 8


def test_nothing_is_recorded_without_a_listener(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    assert llm.engine.kv._pool.events is None
    heard = []
    llm.engine.add_kv_event_listener(heard.append)
    llm.generate([{"prompt_token_ids": list(range(100, 140))}], SamplingParams(max_tokens=2), use_tqdm=False)
    stored = [e for batch in heard for e in batch if type(e).__name__ == "BlockStored"]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 2  # one chain's two full blocks, one event
    assert stored[0].parent_block_hash is None
    assert set(stored[0].block_hashes) == llm.engine.kv.named_blocks()


def test_a_listener_that_raises_does_not_break_the_step(tiny_checkpoint, caplog):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    heard = []

    def broken(events):
        raise RuntimeError("the listener's bug")

    llm.engine.add_kv_event_listener(broken)
    llm.engine.add_kv_event_listener(heard.append)  # a later listener still hears every step
    out = llm.generate([{"prompt_token_ids": list(range(100, 140))}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and heard
    assert "a KV event listener failed" in caplog.text


def test_a_chain_in_one_step_is_one_event_and_its_next_block_names_its_parent():
    log = KVEventLog(16)
    log.stored(b"a", None, [1] * 16)
    log.stored(b"b", b"a", [2] * 16)
    log.stored(b"x", None, [3] * 16)
    log.removed(b"a")
    log.removed(b"b")
    events = log.drain()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [b"a", b"b"] and len(events[0].token_ids) == 32
    assert events[2].block_hashes == [b"a", b"b"] and log.drain() == []


@pytest.mark.parametrize("text, said", [
    ("{not json", "not valid JSON"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
    ('{"enable_kv_cache_events": true, "endpoit": "tcp://*:5557"}', "no field endpoit"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "not a ZMQ endpoint"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive integer"),
    ('{"enable_kv_cache_events": true, "wire_format": "json"}', "wire_format 'json'"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://[::1:5557"}', "not a ZMQ endpoint"),
    ("[1]", "JSON object"),
])
def test_a_bad_config_is_refused_with_the_fix(text, said):
    from nanoserve import EngineConfig

    with pytest.raises(ConfigError, match=said):
        EngineConfig(kv_events_config=text)


def test_events_off_or_null_publish_nothing():
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').publishing
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishing
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publishing


def test_wildcards_ipc_and_inproc_bind_and_a_named_host_connects():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv") and binds("inproc://kv")
    assert binds("tcp://0.0.0.0:5557")  # every interface: no host to connect to
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://router.example:5557")
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://[::1]:5557"}')


def test_each_rank_has_its_own_endpoint():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def _bound(publisher, which: str = "_pub") -> str:
    """The address a publisher's socket really listens on, as ZMQ reports it."""
    return getattr(publisher, which).getsockopt(zmq.LAST_ENDPOINT).decode()


def test_vllms_default_wildcard_binds_loopback_and_says_how_to_publish_further(caplog):
    """tcp://*:PORT (vLLM's default) names no address: the events (every prompt's token ids, no key) are bound
    on 127.0.0.1 only, the replay socket's too, and the log says where and how to publish on every interface. A
    subscriber on 127.0.0.1 hears them."""
    from nanoserve.kv.publisher import ZmqEventPublisher

    port, replay = _free_port(), _free_port()
    config = KVEventsConfig.parse(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                              "replay_endpoint": f"tcp://*:{replay}", "topic": "t"}))
    with caplog.at_level("WARNING", logger="nanoserve.kv"):
        publisher = ZmqEventPublisher(config)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", "t")
    try:
        assert _bound(publisher) == f"tcp://127.0.0.1:{port}" == publisher.endpoint
        assert _bound(publisher, "_replay") == f"tcp://127.0.0.1:{replay}"
        said = caplog.text
        assert f"publishes on tcp://127.0.0.1:{port}, loopback only" in said and f"tcp://0.0.0.0:{port}" in said
        deadline = time.monotonic() + 10  # a SUB socket hears only what is sent after it has joined
        while not sub.kinds and time.monotonic() < deadline:
            publisher.publish([records.AllBlocksCleared()])
            sub.drain(100)
        assert "AllBlocksCleared" in sub.kinds
    finally:
        publisher.close()
        sub.close()


def test_an_explicit_every_interface_address_binds_as_asked_with_a_warning(caplog):
    """tcp://0.0.0.0:PORT is an operator's choice: bound on every interface (vLLM would connect to it), and the
    log warns that the token ids go out with no key."""
    from nanoserve.kv.publisher import ZmqEventPublisher

    port = _free_port()
    config = KVEventsConfig.parse(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://0.0.0.0:{port}"}))
    with caplog.at_level("WARNING", logger="nanoserve.kv"):
        publisher = ZmqEventPublisher(config)
    try:
        assert _bound(publisher) == f"tcp://0.0.0.0:{port}" == publisher.endpoint
        assert f"token ids of every cached block on tcp://0.0.0.0:{port} with no key" in caplog.text
    finally:
        publisher.close()
