"""The streamed read in torch (the CPU's streamed read) against the float64 dense oracle and against the Triton
kernel it mirrors (interpreted here), and the engine's dispatch to it without CUDA."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention.dispatch import PagedRead
from nanoserve.attention.streamed import streamed_decode
from nanoserve.attention.tiled import tiled_decode
from tests.test_streamed_read import CASES, TOLERANCE, dense_oracle, random_case


@pytest.mark.parametrize("rows,heads,kv_heads,dim,block_size,tile,dtype,splits", CASES)
def test_tiled_read_equals_float64_oracle_and_the_triton_kernel(rows, heads, kv_heads, dim, block_size, tile,
                                                                dtype, splits):
    q, k, v, table, lens = random_case(rows, heads, kv_heads, dim, block_size, dtype, seed=rows * 7 + dim)
    scale = dim**-0.5
    ours = tiled_decode(q, k, v, table, lens, scale, tile)
    assert ours.dtype == dtype and ours.shape == q.shape
    assert (ours.double() - dense_oracle(q, k, v, table, lens, scale)).abs().max().item() < TOLERANCE[dtype]
    kernel = streamed_decode(q, k, v, table, lens, scale, block=tile, splits=splits)
    assert (ours.double() - kernel.double()).abs().max().item() < TOLERANCE[dtype]


def test_a_row_whose_tiles_all_lie_past_its_context_is_unaffected():
    """The widest row sets the tile count; a one-token row's later tiles are all masked and must add nothing."""
    q, k, v, table, lens = random_case(3, 4, 2, 64, 16, torch.float32, seed=3, max_len=200)
    lens[0] = 1
    scale = 64**-0.5
    ours = tiled_decode(q, k, v, table, lens, scale, 16)
    assert torch.isfinite(ours).all()
    assert (ours.double() - dense_oracle(q, k, v, table, lens, scale)).abs().max().item() < 2e-5


def test_a_bucketed_table_wide_as_the_model_walks_no_tile_past_the_longest_row():
    """Decode buckets hand the read a block table as wide as max_model_len. The columns past every row's end are
    never read: the output is the narrow table's bit for bit even when those blocks hold NaN (a masked tile that
    was walked would add 0 x NaN), which is also why a bucketed streamed step costs what an unbucketed one does."""
    q, k, v, table, lens = random_case(3, 4, 2, 64, 16, torch.float32, seed=5, max_len=70)
    scale = 64**-0.5
    narrow = tiled_decode(q, k, v, table, lens, scale, 16)
    spare = torch.arange(k.shape[0], k.shape[0] + 64).expand(3, 64)  # 64 more blocks a row, all poisoned
    k_wide = torch.cat([k, torch.full((64, *k.shape[1:]), float("nan"))])
    v_wide = torch.cat([v, torch.full((64, *v.shape[1:]), float("nan"))])
    wide = tiled_decode(q, k_wide, v_wide, torch.cat([table, spare], 1), lens, scale, 16)
    assert torch.equal(wide, narrow)


def test_without_cuda_the_streamed_read_runs_the_torch_tiles(monkeypatch):
    import nanoserve.attention.streamed as triton_read

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on a CPU tensor")

    monkeypatch.setattr(triton_read, "streamed_decode", refuse)
    q, k, v, table, lens = random_case(2, 8, 2, 64, 16, torch.float32, seed=1)
    read = PagedRead("streamed", 32)
    out = read.decode(q, k, v, table, lens, 64**-0.5)
    assert (out.double() - dense_oracle(q, k, v, table, lens, 64**-0.5)).abs().max().item() < 2e-5
    assert read.stats().held_cells == 2 * 8 * 32  # one tile alive, counted from shapes
