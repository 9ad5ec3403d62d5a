"""CUDA-graph capture and replay (skipped without CUDA): replay equals eager to the last token."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.test_engine_crowd import MIXED

pytestmark = pytest.mark.gpu


def cuda_llm(path, **flags) -> LLM:
    return LLM(model=str(path), device="cuda", dtype="float32", max_model_len=256, kv_cache_gib=0.05, **flags)


def tokens(outputs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.parametrize("crowd", [1, 3, 5, 10])
def test_replay_equals_eager_across_bucket_sizes(ckpt, crowd):
    prompts, params = [p for p, _ in MIXED[:crowd]], [s for _, s in MIXED[:crowd]]
    eager = cuda_llm(ckpt).generate(prompts, params)
    llm = cuda_llm(ckpt, cuda_graphs=True, max_num_seqs=16)
    replayed = llm.generate(prompts, params)
    assert tokens(replayed) == tokens(eager)
    capture = llm.engine.stats().as_dict()["capture"]
    assert capture["captures"] == capture["shapes"] > 0 and capture["replays"] > 0
    assert capture["eager_steps"] == 0 and capture["pool_bytes"] > 0
    llm.engine.audit()


def test_a_request_at_max_model_len(ckpt):
    ids = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=256 - len(ids), ignore_eos=True)
    eager = cuda_llm(ckpt).generate([ids], params)
    replayed = cuda_llm(ckpt, cuda_graphs=True).generate([ids], params)
    assert len(replayed[0].outputs[0].token_ids) == 256 - len(ids)
    assert tokens(replayed) == tokens(eager)


def test_padded_rows_leave_real_sequences_untouched(ckpt):
    llm = cuda_llm(ckpt, cuda_graphs=True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"prompt {i}", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    before = engine.cache.k.clone()
    engine.step()  # 3 rows replayed in the 4-row graph
    assert engine.decode_path.last_plan.shape[0] == 4 and engine.captured.stats.replays == 1
    changed = (engine.cache.k != before).flatten(2).any(-1)
    held = {b for r in engine.scheduler.running for b in r.blocks}
    assert set(changed.nonzero()[:, 1].tolist()) <= held | {0}


def test_replay_share_near_one_in_steady_decode(ckpt):
    llm = cuda_llm(ckpt, cuda_graphs=True)
    llm.generate([f"row {i}" for i in range(4)], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    capture = llm.engine.stats().as_dict()["capture"]
    assert capture["replay_share"] == 1.0 and capture["replays"] >= 199
    read = llm.engine.stats().paged_read
    assert read.calls == llm.engine.model_config.num_layers * capture["replays"]  # every replay charged its reads


def test_bundle_switches_everything_on(ckpt):
    engine = cuda_llm(ckpt, cuda_graphs=True).engine
    stats = engine.stats().as_dict()
    assert {"inputs", "buckets", "capture"} <= set(stats) and stats["inputs"]["persistent"]
    assert engine.decode_path.table.compaction
