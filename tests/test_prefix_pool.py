"""BlockPool's prefix cache on its own: names, hits checked against content, eviction order, the audit."""

from __future__ import annotations

import pytest

from nanoserve.kv.pool import BlockPool
from nanoserve.kv.prefix import BlockNames, root_hash, sha256_block

BS = 4


def named(pool: BlockPool, tokens: list[int], stub=None) -> tuple[list[int], list[bytes]]:
    """Allocate and commit the full blocks of `tokens` as one sequence would; returns (blocks, names)."""
    names = BlockNames().extend(lambda a, b: tokens[a:b], len(tokens) // BS, BS, root_hash("m"), stub or sha256_block)
    blocks = pool.allocate(len(names))
    for i, (b, n) in enumerate(zip(blocks, names)):
        assert pool.cache_full_block(b, n, tokens[i * BS:(i + 1) * BS], blocks[i - 1] if i else None)
    return blocks, names


def test_a_freed_sequence_is_evicted_tail_first_and_the_least_recently_freed_first():
    pool = BlockPool(7, BS)  # 6 usable
    a, _ = named(pool, list(range(12)))  # 3 blocks
    b, _ = named(pool, list(range(100, 112)))
    pool.free(a)
    pool.free(b)
    order = [pool.allocate(1)[0] for _ in range(6)]
    assert order == [a[2], a[1], a[0], b[2], b[1], b[0]]  # a before b; each one's tail before its head
    assert pool.evictions == 6 and pool.num_cached == 0


def test_a_hit_is_taken_off_the_free_queue_and_shared():
    pool = BlockPool(9, BS)
    tokens = list(range(12))
    blocks, names = named(pool, tokens)
    pool.free(blocks)
    hits = pool.cached_run(names, lambda i: tokens[i * BS:(i + 1) * BS])
    assert hits == blocks and pool.num_free_among(hits) == 3
    pool.hold(hits)
    pool.hold(hits[:2])  # a second sequence shares the first two
    assert [pool.refcounts[b] for b in blocks] == [2, 2, 1] and pool.num_free == 5
    pool.audit({"one": blocks, "two": blocks[:2]})
    pool.free(blocks[:2])
    pool.free(blocks)
    pool.audit({})
    assert pool.num_free == 8 and pool.num_cached == 3  # free, and still named


def test_a_colliding_name_never_serves_other_content():
    pool = BlockPool(9, BS)
    stub = lambda parent, tokens: b"same name for everything"  # noqa: E731
    first, names = named(pool, [1, 2, 3, 4], stub)
    other = [9, 9, 9, 9]
    assert pool.cached_run(names, lambda i: other) == []  # same name, other tokens: a miss
    assert pool.cached_run(names, lambda i: [1, 2, 3, 4]) == first
    # a first block whose tokens repeat in second place: same name, same tokens, another parent
    assert pool.cached_run([b"same name for everything"] * 2, lambda i: [1, 2, 3, 4]) == first


def test_a_sequence_tail_goes_first_and_a_renamed_parent_breaks_the_chain():
    pool = BlockPool(3, BS)  # 2 usable
    tokens = list(range(8))
    blocks, names = named(pool, tokens)
    pool.free(blocks)
    pool.allocate(1)  # evicts the tail: the head is still a hit
    assert pool.cached_run(names, lambda i: tokens[i * BS:(i + 1) * BS]) == blocks[:1]
    blind = lambda parent, tokens: bytes(tokens)  # noqa: E731  (a name that ignores the parent)
    pool = BlockPool(5, BS)
    (p, c), names = named(pool, tokens, blind)
    pool.uncache([p])  # the parent's content is gone (its step failed) ...
    assert pool.cache_full_block(p, names[0], tokens[:BS], None)  # ... and the same block is named again: a new generation
    assert pool.cached_run(names, lambda i: tokens[i * BS:(i + 1) * BS]) == [p]  # the old child is not its child


def test_reset_forgets_names_but_not_holders():
    pool = BlockPool(9, BS)
    blocks, names = named(pool, list(range(8)))
    assert pool.reset_cache() == 2 and pool.num_cached == 0
    pool.audit({"holder": blocks})
    assert pool.cached_run(names, lambda i: list(range(8))[i * BS:(i + 1) * BS]) == []


def test_the_audit_catches_a_leak_and_a_double_count():
    pool = BlockPool(5, BS)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError, match="leaked"):
        pool.audit({"one": blocks[:1]})
    pool.hold(blocks[:1])
    with pytest.raises(AssertionError, match="refcount 2 but 1 holders"):
        pool.audit({"one": blocks})
