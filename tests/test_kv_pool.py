"""BlockPool: the null block is never handed out, and audit() catches every way a block can go astray."""

from __future__ import annotations

import pytest

from nanoserve.kv.pool import NULL_BLOCK, BlockPool, PoolExhausted


def test_allocate_free_round_trip_never_hands_out_the_null_block():
    pool = BlockPool(9, 16)
    assert pool.num_usable == 8 == pool.num_free
    blocks = pool.allocate(8)
    assert NULL_BLOCK not in blocks and sorted(blocks) == list(range(1, 9))
    assert pool.num_free == 0 and pool.num_used == 8
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_free == 8
    pool.audit({})


def test_blocks_for_rounds_up():
    pool = BlockPool(4, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_audit_passes_for_live_owners():
    pool = BlockPool(10, 4)
    a, b = pool.allocate(3), pool.allocate(2)
    pool.audit({"a": a, "b": b})


def test_audit_catches_a_leak():
    pool = BlockPool(10, 4)
    a = pool.allocate(3)
    pool.allocate(1)  # nobody owns this one
    with pytest.raises(AssertionError, match="leaked"):
        pool.audit({"a": a})


def test_audit_catches_a_free_block_still_held():
    pool = BlockPool(10, 4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(AssertionError, match="free but held"):
        pool.audit({"ghost": a})


def test_audit_catches_the_null_block_in_a_table():
    pool = BlockPool(10, 4)
    a = pool.allocate(1)
    with pytest.raises(AssertionError, match="null block"):
        pool.audit({"a": [*a, NULL_BLOCK]})


def test_double_free_and_null_free_are_refused():
    pool = BlockPool(10, 4)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match="not held"):
        pool.free(a)
    with pytest.raises(RuntimeError, match="not held"):
        pool.free([NULL_BLOCK])


def test_refcount_mismatch_is_caught():
    pool = BlockPool(10, 4)
    a = pool.allocate(1)
    with pytest.raises(AssertionError, match="refcount"):
        pool.audit({"x": a, "y": a})  # two holders, refcount 1


def test_a_pool_needs_room_beyond_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, 16)


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_a_cpu_pool_is_zeros_resident_only_where_written():
    """The KV storage is zeros (a masked position must never be a NaN from an old allocation), page aligned,
    and on the CPU its pages become resident as blocks are written, not at load (a 3B model's pool cost a second
    of load when written whole up front)."""
    import torch

    from nanoserve.kv.cache import zero_filled

    before = _resident_mib()
    pool = zero_filled((4, 64, 1024, 256), torch.bfloat16, "cpu")  # 128 MiB
    assert _resident_mib() - before < 32
    assert pool.data_ptr() % 64 == 0 and pool.dtype == torch.bfloat16 and pool.shape == (4, 64, 1024, 256)
    pool[1, 7].fill_(1.5)
    assert torch.count_nonzero(pool) == 1024 * 256 and pool.double().sum() == 1.5 * 1024 * 256
    assert _resident_mib() - before < 64
