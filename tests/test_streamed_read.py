"""The streamed read: the Triton kernel (interpreted on the CPU) against a float64 dense oracle, its wiring
through PagedRead and the engine, its counters, and the bytes two live servers send."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention.dispatch import PagedRead
from nanoserve.attention.streamed import streamed_decode
from nanoserve.config import EngineConfig
from nanoserve.errors import ConfigError
from tests.helpers import counters
from tests.test_engine_crowd import MIXED, assert_same
from tests.test_engine_crowd import make as crowd_make


def make(path, **flags):
    """An engine without batch invariance: the two reads compared here are its reads (the streamed read is
    refused beside the batch-invariant attention)."""
    return crowd_make(path, **{"batch_invariant": False, **flags})


def dense_oracle(q, k_cache, v_cache, table, lens, scale):
    """Plain attention in float64, row by row, from the blocks the table names (no shared code with the reads)."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        keys = torch.cat([k_cache[int(b)] for b in table[r]]).double()[:n]  # [n, kv_heads, dim]
        vals = torch.cat([v_cache[int(b)] for b in table[r]]).double()[:n]
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            scores = keys[:, kvh] @ q[r, h].double() * scale
            out[r, h] = torch.softmax(scores, 0) @ vals[:, kvh]
    return out


def random_case(rows, heads, kv_heads, dim, block_size, dtype, seed, blocks=48, max_len=90):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    lens = torch.randint(1, max_len, (rows,), generator=gen)
    width = max(math.ceil(int(n) / block_size) for n in lens) + 1  # one spare column, as a wider bucket has
    table = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        used = math.ceil(int(lens[r]) / block_size)
        table[r, :used] = torch.randperm(blocks - 1, generator=gen)[:used] + 1  # scattered, never the null block
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    return q, k, v, table, lens


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}
CASES = [  # rows, heads, kv_heads, dim, block_size, tile, dtype, splits
    (1, 4, 4, 64, 16, 16, torch.float32, 1),
    (3, 8, 2, 64, 16, 32, torch.float32, 1),
    (2, 8, 1, 128, 8, 16, torch.float32, 1),
    (5, 4, 2, 64, 32, 16, torch.float32, 2),
    (2, 12, 4, 128, 16, 64, torch.float32, 3),
    (4, 4, 2, 64, 16, 16, torch.float16, 1),
    (3, 8, 8, 64, 16, 32, torch.bfloat16, 2),
    (2, 16, 2, 128, 16, 16, torch.bfloat16, 1),
]


@pytest.mark.parametrize("rows,heads,kv_heads,dim,block_size,tile,dtype,splits", CASES)
def test_kernel_equals_dense_float64(rows, heads, kv_heads, dim, block_size, tile, dtype, splits):
    q, k, v, table, lens = random_case(rows, heads, kv_heads, dim, block_size, dtype, seed=rows * 31 + heads)
    scale = dim**-0.5
    got = streamed_decode(q, k, v, table, lens, scale, tile, splits=splits)
    assert got.dtype == dtype and got.shape == (rows, heads, dim)
    err = (got.double() - dense_oracle(q, k, v, table, lens, scale)).abs().max().item()
    assert err < TOLERANCE[dtype], err


def test_lengths_that_are_not_multiples_of_the_tile():
    for n, tile in itertools.product((1, 15, 16, 17, 33, 64), (16, 32)):
        q, k, v, table, _ = random_case(1, 4, 2, 64, 16, torch.float32, seed=n)
        lens = torch.tensor([n])
        table = torch.arange(1, 6).view(1, 5)
        got = streamed_decode(q, k, v, table, lens, 0.125, tile)
        assert (got.double() - dense_oracle(q, k, v, table, lens, 0.125)).abs().max() < 2e-5, (n, tile)


def test_paged_read_counts_a_tile_not_a_rectangle():
    q, k, v, table, lens = random_case(3, 8, 2, 64, 16, torch.float32, seed=5)
    width = table.shape[1] * 16
    streamed, gathered = PagedRead("streamed", 16), PagedRead("gathered")
    before = streamed.stats()
    a = streamed.decode(q, k, v, table, lens, 0.125)
    b = gathered.decode(q, k, v, table, lens, 0.125)
    assert (a - b).abs().max() < 2e-5
    window = streamed.stats().since(before)  # the counter read twice
    assert (window.calls, window.rows, window.score_cells) == (1, 3, 3 * 8 * width)
    assert window.held_cells == 3 * 8 * 16 and window.saving == width / 16
    assert gathered.stats().saving == 1.0  # a measurement: the rectangle holds what it is charged
    with pytest.raises(ValueError, match="different reads"):
        streamed.stats().since(gathered.stats())
    with pytest.raises(ValueError, match="power of two >= 16"):
        PagedRead("streamed", 8)


def test_engine_flag_reaches_the_read_and_changes_no_token(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    crowd = MIXED[:6]
    plain = make(ckpt).generate([p for p, _ in crowd], [s for _, s in crowd])
    llm = make(ckpt, streamed_read=True, read_block=16)
    before = llm.engine.stats().paged_read
    streamed = llm.generate([p for p, _ in crowd], [s for _, s in crowd])
    assert_same(streamed, plain)
    window = llm.engine.stats().paged_read.since(before)
    assert window.calls > 0 and window.saving > 1.0  # the flag reached the streamed arm, and the counter shows it
    assert llm.engine.stats().as_dict()["paged_read"]["mode"] == "streamed"


def test_buckets_lose_the_width_axis(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    gathered = make(ckpt, decode_buckets=True).engine.runner.decode_path.buckets
    streamed = make(ckpt, decode_buckets=True, streamed_read=True, read_block=16).engine.runner.decode_path.buckets
    assert len(gathered.shapes) == 7 * 5 and len(streamed.shapes) == 7  # 64 rows; 256 tokens = 16 blocks
    llm = make(ckpt, decode_buckets=True, persistent_inputs=True, streamed_read=True, read_block=16)
    out = llm.generate(["a b c", "d e"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ref = make(ckpt).generate(["a b c", "d e"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert_same(out, ref)


def test_read_block_is_checked():
    with pytest.raises(ConfigError, match="read_block must be a power of two >= 16"):
        EngineConfig(device="cpu", read_block=24)


def test_two_live_servers_one_flag_apart_send_identical_bytes(tiny_checkpoint):
    """Acceptance downstream of the sampler: six clients over four row slots, greedy and seeded sampled."""
    from nanoserve.ab import ab_requests, run_ab, variant
    from nanoserve.workload import pick_prompts

    base = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01, device="cpu",
                        max_num_seqs=4, batch_invariant=False)  # the two reads of the engine without invariance
    result = run_ab(base, variant(base, "streamed_read=on read_block=16"), ab_requests(pick_prompts(8), 16),
                    concurrency=6)
    assert result.all_identical, [v.label for v in result.verdicts]
    assert result.crowded and result.a.peak_running >= 2 and result.b.peak_running >= 2
    assert counters(result)["paged_read.mode"] == ("gathered", "streamed")


def test_llm_api_accepts_the_flags(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, streamed_read=True,
              batch_invariant=False, read_block=32)
    assert llm.engine.runner.read.mode == "streamed" and llm.engine.runner.read.block == 32
