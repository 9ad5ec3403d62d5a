"""Tensor parallelism's rank 0 store takes any caller that reaches its port, and the ranks unpickle what they read
from it: every such value is signed with the group's key, and one that is not (a stranger's, another key's, a
signed value moved to another name) is refused unread. A group across machines does not start without the key."""

from __future__ import annotations

import datetime
import pickle

import pytest
import torch
import torch.distributed as dist

from nanoserve.errors import ConfigError
from nanoserve.parallel import worker
from nanoserve.parallel.group import TensorGroup, free_loopback_address
from nanoserve.parallel.sealed import KEY_ENV, Unauthenticated, seal

KEY = b"k" * 32


class Payload:
    """What an attacker stores: loading it runs code (here it only creates a file)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def group():
    group = TensorGroup(0, 1, free_loopback_address(), torch.device("cpu"), 30.0, KEY)
    yield group
    group.close()


def _stranger(group) -> dist.TCPStore:
    """Another process's client of rank 0's store, as anyone who reaches the port can open."""
    host, port = group.store.host, group.store.port
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_value_a_stranger_wrote_to_the_store_is_refused_unread(group, tmp_path):
    marker = tmp_path / "ran"
    _stranger(group).set("hello", pickle.dumps(Payload(marker)))
    with pytest.raises(Unauthenticated, match=rf"'hello' .* not signed with the group's key.*{KEY_ENV}"):
        group.take("hello", "rank 0's flags")
    assert not marker.exists()  # nothing was unpickled


def test_only_values_signed_with_the_key_for_their_name_are_read(group, tmp_path):
    group.put("load/0", {"fine": True})
    assert group.take("load/0", "rank 0's load") == {"fine": True}
    stranger = _stranger(group)
    stranger.set("hello", seal(b"another key " * 3, "hello", pickle.dumps(Payload(tmp_path / "a"))))
    with pytest.raises(Unauthenticated):
        group.take("hello", "rank 0's flags")
    stranger.set("hello", stranger.get("load/0"))  # a signed value, moved to another name
    with pytest.raises(Unauthenticated):
        group.take("hello", "rank 0's flags")
    stranger.set("failed/1", b"x" * 40)  # a forged failure report is not rank 1's word
    assert group.failure_of(1) is None and group.reported_failure() is None


def test_a_group_across_machines_needs_the_key_on_every_rank(tiny_checkpoint, monkeypatch, capsys):
    from nanoserve import LLM

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"--distributed-init needs a shared secret, and {KEY_ENV} is not set"):
        LLM(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, distributed_init="tcp://127.0.0.1:9",
            max_model_len=256, kv_cache_gib=0.02)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(SystemExit) as stopped:
        worker.main(["--rank", "1", "--tensor-parallel-size", "2", "--distributed-init", "tcp://127.0.0.1:9"])
    assert stopped.value.code == 2
    assert f"{KEY_ENV} has 5 characters, fewer than 16" in capsys.readouterr().err
