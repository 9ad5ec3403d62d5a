"""The compiled streamed kernel on CUDA (skipped without it): equal to the float64 oracle, splits included."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention import streamed
from nanoserve.attention.streamed import choose_splits, streamed_decode
from tests.test_streamed_read import CASES, TOLERANCE, dense_oracle, random_case

pytestmark = pytest.mark.gpu


def test_the_kernel_runs_on_the_device_not_in_the_interpreter():
    """Triton's interpreter would pass every test below too (it runs the kernel on the host, in numpy): the
    profiler must see the compiled kernel launched on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, table, lens = random_case(4, 8, 2, 64, 16, torch.float16, seed=1)
    args = (q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda(), 64**-0.5, 64)
    streamed_decode(*args)  # compiled before profiling
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        streamed_decode(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_streamed_decode" in name for name in kernels), kernels
    assert streamed.INTERPRETED is False


@pytest.mark.parametrize("rows,heads,kv_heads,dim,block_size,tile,dtype,splits", CASES)
def test_compiled_kernel_equals_dense_float64(rows, heads, kv_heads, dim, block_size, tile, dtype, splits):
    q, k, v, table, lens = random_case(rows, heads, kv_heads, dim, block_size, dtype, seed=rows * 31 + heads)
    want = dense_oracle(q, k, v, table, lens, dim**-0.5)
    got = streamed_decode(q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda(), dim**-0.5, tile, splits=splits)
    assert (got.cpu().double() - want).abs().max().item() < TOLERANCE[dtype]


def test_one_long_request_is_split_across_programs():
    q, k, v, table, lens = random_case(1, 32, 8, 128, 16, torch.bfloat16, seed=3, blocks=300, max_len=4000)
    tiles = -(-table.shape[1] * 16 // 64)
    # one row, eight kv heads: too few programs without splits
    assert choose_splits(1, 8, tiles, torch.device("cuda")) > 1
    got = streamed_decode(q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda(), 128**-0.5, 64)
    want = dense_oracle(q, k, v, table, lens, 128**-0.5)
    assert (got.cpu().double() - want).abs().max().item() < TOLERANCE[torch.bfloat16]
