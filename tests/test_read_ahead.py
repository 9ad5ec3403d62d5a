"""Reading the next weight ahead (--read-ahead; kernels/linear.c's idle worker, model/quant/read_ahead.py's chain):
it moves bytes into the cache and nothing else, so an engine with it and one without give the same bits; its
counter is the worker's own count of the bytes it asked for; and a weight named and then freed costs nothing, since
the worker only ever issues prefetches, which do not fault."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.gguf_oracles import Q4_K_M_MIX, write_mixed
from tests.kquant_encode import encode_k


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller and one pool worker: the worker is the one that reads ahead
    yield
    torch.set_num_threads(before)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([[5, 80, 81, 200, 7], [40, 41], list(range(3, 60, 3))], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs]) for o in outs]


def test_reading_ahead_changes_no_value_and_the_flag_turns_it_off(kernels, tmp_path, two_threads):
    _, path = write_mixed(tmp_path / "tiny-q4_k_m.gguf", Q4_K_M_MIX, "Q4_K")
    common = dict(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01)
    on, off = LLM(**common), LLM(**common, read_ahead=False)
    status = on.engine.stats().features["fused"]["read_ahead"]
    assert status["linears"] == 2 * 4 + 1 and status["off"] == ""  # every projection of 2 layers, and the head
    assert off.engine.stats().features["fused"]["read_ahead"] == {
        "linears": 0, "asked_bytes": kernels.read_ahead_bytes, "off": "--no-read-ahead"}
    assert _generate(on) == _generate(off)
    chained = [m for m in on.engine.runner.model.modules() if getattr(m, "read_chain", None) is not None]
    assert all(m.read_next is not None for m in chained)  # each learned its successor, the head the first layer's


def test_the_counter_is_the_workers_and_a_freed_weight_costs_nothing(kernels, two_threads):
    """A weight named and unmapped before the worker reads it: the worker asks for its bytes anyway (the counter
    moves by what it asked) and the process lives on, where a load from the unmapped range would have killed it."""
    raw = torch.from_numpy(encode_k(np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32), "Q4_K"))
    weight, x = kernels.kx16_pack("Q4_K", raw, 512), torch.randn(1, 512)
    y = torch.empty(1, 64)
    region = mmap.mmap(-1, 1 << 20)
    address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    region.close()  # unmapped: the address now names nothing
    before = kernels.read_ahead_bytes
    posts = 0
    for _ in range(50):  # the worker polls for 50 us after a job; a busy machine may not run it in time
        kernels.kx16_call(kernels.kx16_types["Q4_K"], weight.data_ptr(), x.data_ptr(), 1, 512, 64, 64, None,
                          y.data_ptr(), 2, 0)
        kernels.read_ahead(address, 1 << 20)
        posts += 1
        time.sleep(0.002)
        if kernels.read_ahead_bytes > before:
            break
    asked = kernels.read_ahead_bytes - before
    assert 0 < asked <= posts << 20  # each post is a new hint: a worker late for one may read it and the next
    kernels.read_ahead(None, 0)
