"""The data-parallel router on its own: prefix affinity within the imbalance bound, then load, then in turn."""

from __future__ import annotations

import pytest

from nanoserve.dp.routing import ReplicaView, Router, prompt_chain
from nanoserve.kv.manager import KVManager
from nanoserve.kv.prefix import root_hash


class _Stored:  # the two fields the router reads of kv.events' records, under their class names
    def __init__(self, names):
        self.block_hashes = list(names)


BlockStored = type("BlockStored", (_Stored,), {})
BlockRemoved = type("BlockRemoved", (_Stored,), {})
AllBlocksCleared = type("AllBlocksCleared", (), {})


def _views(n=2):
    return [ReplicaView(rank, ready=True) for rank in range(n)]


def test_the_chain_is_the_kv_managers_own():
    """A prompt's names here are the names the replica's pool gives the same tokens (so a match is a hit)."""
    kv = KVManager(16, 4, prefix_caching=True, cache_identity=("m", "none", "float32"))
    ids = list(range(100, 111))  # 11 tokens: two full blocks short of the last token

    class Req:
        serial, prompt_logprobs, cache_salt, num_tokens, num_computed = 1, None, None, len(ids), 0
        blocks, num_cached_tokens, prompt_ids = [], None, ids

        def __init__(self):
            self.cache_written = {}

        def tokens(self, a, b):
            return ids[a:b]

    kv.admit(Req(), kv.cached_prefix(Req()), len(ids))
    assert prompt_chain(ids, 4, kv.cache_root) == kv._names[1].hashes[:2]
    assert prompt_chain(ids, 4, kv.cache_root, "tenant") != prompt_chain(ids, 4, kv.cache_root)
    assert prompt_chain(ids, 4, kv.cache_root, "tenant")[0] != prompt_chain(ids, 4, root_hash(b"other"))[0]


def test_affinity_picks_the_replica_holding_the_longest_prefix():
    views = _views(3)
    chain = [b"a", b"b", b"c"]
    views[1].apply([BlockStored([b"a"])])
    views[2].apply([BlockStored([b"a", b"b"])])
    router = Router("prefix-affinity", imbalance=4)
    assert router.pick(views, chain).rank == 2
    assert views[2].routed == 1 and views[2].matched_blocks == 2 and views[2].prompt_blocks == 3


def test_events_remove_and_clear_what_the_router_knows():
    view = ReplicaView(0, ready=True)
    view.apply([BlockStored([b"a", b"b"]), BlockRemoved([b"b"])])
    assert view.cached == {b"a"} and view.matched([b"a", b"b"]) == 1
    view.apply([AllBlocksCleared()])
    assert view.matched([b"a"]) == 0


def test_affinity_gives_way_to_a_replica_a_batch_less_loaded():
    views = _views(2)
    views[0].apply([BlockStored([b"a"])])
    router = Router("prefix-affinity", imbalance=2)
    views[0].in_flight = 1
    assert router.pick(views, [b"a"]).rank == 0  # one more in flight than replica 1: still within the bound
    views[0].in_flight = 2
    assert router.pick(views, [b"a"]).rank == 1  # two more: replica 1 takes it (and will compute the prefix)


def test_load_orders_waiting_then_running_then_kv_use():
    views = _views(3)
    views[0].in_flight, views[0].running = 3, 1  # two waiting
    views[1].in_flight, views[1].running = 2, 2  # none waiting, two running
    views[2].in_flight, views[2].running, views[2].kv_usage = 2, 2, 0.5
    assert Router("least-loaded").pick(views, []).rank == 1
    views[1].kv_usage = 0.9
    assert Router("least-loaded").pick(views, []).rank == 2


def test_ties_go_in_turn_and_only_ready_replicas_are_picked():
    views = _views(2)
    router = Router("least-loaded")
    assert [router.pick(views, []).rank for _ in range(4)] == [0, 1, 0, 1]
    views[0].ready = False
    assert {router.pick(views, []).rank for _ in range(3)} == {1}
    views[1].ready = False
    assert router.pick(views, []) is None


def test_round_robin_ignores_the_cache():
    views = _views(2)
    views[0].apply([BlockStored([b"a"])])
    router = Router("round-robin")
    assert [router.pick(views, [b"a"]).rank for _ in range(4)] == [0, 1, 0, 1]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="prefix-affinity"):
        Router("random")
