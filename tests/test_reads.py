"""The gathered read against a plain dense attention in float64, and what ReadStats publishes."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention.dispatch import PagedRead, ReadStats


def dense_oracle(q, k_cache, v_cache, tables, lens, scale):
    """Per row and head: gather the row's tokens one by one, softmax in float64."""
    rows, heads, dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        slots = [(int(tables[r][p // bs]), p % bs) for p in range(n)]
        for h in range(heads):
            kh = torch.stack([k_cache[b, o, h // group] for b, o in slots]).double()
            vh = torch.stack([v_cache[b, o, h // group] for b, o in slots]).double()
            w = torch.softmax((kh @ q[r, h].double()) * scale, dim=0)
            out[r, h] = w @ vh
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 64), (9, 3, 64), (4, 1, 128)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gathered_read_matches_dense_float64(heads, kv_heads, dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    rows, num_blocks = 5, 128
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    lens = torch.tensor([1, 7, 33, 2, 50])[:rows]
    width = max(-(-int(n) // block_size) for n in lens)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # never the null block
    tables, used = [], 0
    for n in lens.tolist():
        need = -(-n // block_size)
        tables.append(perm[used : used + need].tolist() + [0] * (width - need))
        used += need
    table = torch.tensor(tables)
    q = torch.randn(rows, heads, dim, generator=g)
    read = PagedRead()
    got = read.decode(q, k_cache, v_cache, table, lens, dim**-0.5)
    want = dense_oracle(q, k_cache, v_cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_padded_table_entries_are_never_read():
    """Entries past a row's length (pointing at garbage blocks) change nothing."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, 4, 2, 16, generator=g)
    v_cache = torch.randn(8, 4, 2, 16, generator=g)
    q = torch.randn(1, 2, 16, generator=g)
    lens = torch.tensor([6])
    a = PagedRead().decode(q, k_cache, v_cache, torch.tensor([[3, 5, 0, 0]]), lens, 0.25)
    b = PagedRead().decode(q, k_cache, v_cache, torch.tensor([[3, 5, 7, 1]]), lens, 0.25)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_stats_count_from_shapes_and_saving_is_one_for_the_gathered_read():
    read = PagedRead()
    k_cache = torch.zeros(4, 16, 2, 8)
    before = read.stats()
    read.decode(torch.zeros(3, 4, 8), k_cache, k_cache, torch.ones(3, 2, dtype=torch.long),
                torch.tensor([1, 20, 32]), 1.0)
    window = read.stats().since(before)
    assert (window.calls, window.rows) == (1, 3)
    assert window.score_cells == 3 * 4 * 32 == window.held_cells
    assert window.saving == 1.0
    assert read.stats().as_dict()["mode"] == "gathered"


def test_since_refuses_readings_of_different_reads():
    with pytest.raises(ValueError, match="different reads"):
        ReadStats("gathered", None, 5).since(ReadStats("streamed", 16, 2))


def test_mismatched_shapes_are_refused():
    k_cache = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="query rows"):
        PagedRead().decode(torch.zeros(3, 4, 8), k_cache, k_cache, torch.ones(2, 2, dtype=torch.long),
                           torch.tensor([1, 2]), 1.0)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="gathered"):
        PagedRead("sideways")
