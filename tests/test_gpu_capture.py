"""CUDA-graph capture and replay (skipped without CUDA): replay equals eager to the last token."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.errors import GateError
from tests.helpers import cells_changed, decode_step_cells
from tests.test_engine_crowd import MIXED, make

pytestmark = pytest.mark.gpu


def cuda_llm(path, **flags) -> LLM:
    """The crowd tests' engine on the GPU, in float32 so replay and eager compare token for token."""
    return make(path, **{"device": "cuda", "dtype": "float32", "kv_cache_gib": 0.05, **flags})


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


@pytest.mark.parametrize("crowd", [3, 10])
def test_replay_equals_eager_with_the_streamed_read(ckpt, crowd):
    """The streamed kernel inside the graphs, one shape per row bucket (no width axis): the same tokens as the
    same decode path run eager, so only the capture differs."""
    prompts, params = [p for p, _ in MIXED[:crowd]], [s for _, s in MIXED[:crowd]]
    path = dict(decode_buckets=True, persistent_inputs=True, row_compaction=True, streamed_read=True, batch_invariant=False,
                max_num_seqs=16)
    eager_llm = cuda_llm(ckpt, **path)
    eager = eager_llm.generate(prompts, params)
    assert eager_llm.engine.runner.captured is None
    llm = cuda_llm(ckpt, cuda_graphs=True, **path)
    replayed = llm.generate(prompts, params)
    assert tokens(replayed) == tokens(eager)
    assert llm.engine.runner.read.mode == "streamed" and len(llm.engine.runner.decode_path.buckets.widths) == 1
    capture = llm.engine.stats().as_dict()["capture"]
    assert capture["captures"] == capture["shapes"] > 0 and capture["replays"] > 0
    assert capture["eager_steps"] == 0 and capture["pool_bytes"] > 0
    llm.engine.audit()


def test_a_request_at_max_model_len(ckpt):
    ids = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=256 - len(ids), ignore_eos=True)
    eager = cuda_llm(ckpt).generate([ids], params)
    llm = cuda_llm(ckpt, cuda_graphs=True)
    replayed = llm.generate([ids], params)
    assert len(replayed[0].outputs[0].token_ids) == 256 - len(ids)
    assert tokens(replayed) == tokens(eager)
    stats = llm.engine.stats().as_dict()
    # every decode step, the last one at a full 16-block table included, ran in a captured graph
    assert stats["capture"]["eager_steps"] == 0
    assert stats["capture"]["replays"] == stats["inputs"]["steps"] == 256 - len(ids) - 1


def test_padded_rows_leave_real_sequences_untouched(ckpt):
    llm = cuda_llm(ckpt, cuda_graphs=True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"prompt {i}", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    # capturing wrote the null block's slot 0 (placeholder rows); clear it so the padded row's write shows
    engine.runner.cache.k[:, 0].zero_()
    engine.runner.cache.v[:, 0].zero_()
    k, v = engine.runner.cache.k.clone(), engine.runner.cache.v.clone()
    engine.step()  # 3 rows replayed in the 4-row graph
    plan, running = engine.runner.decode_path.last_plan, list(engine.scheduler.running)
    assert (plan.rows, plan.shape[0]) == (3, 4) and engine.runner.captured.stats.replays == 1 and len(running) == 3
    want = decode_step_cells(running, engine.config.block_size, padded=True, layers=engine.runner.cache.k.shape[0])
    assert cells_changed(engine.runner.cache.k, k, engine.runner.cache.layout, keys=True) == want
    assert cells_changed(engine.runner.cache.v, v, engine.runner.cache.layout) == want


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
    assert engine.runner.decode_path.table.compaction


def test_capture_refuses_a_path_it_cannot_replay():
    """On CUDA the device is no excuse: a path without fixed addresses in fixed shapes is refused by the gate."""
    from nanoserve.runner.decode.capture import check_capture_possible
    from nanoserve.runner.decode.path import DecodePath

    cuda = torch.device("cuda")
    switches = {"buckets": True, "persistent": True, "compaction": True}
    check_capture_possible(DecodePath(4, 8, 16, cuda, **switches), cuda)
    check_capture_possible(DecodePath(4, 8, 16, cuda, **{**switches, "compaction": False}), cuda)  # table kept
    for off in ({"buckets": False}, {"persistent": False}, {"buckets": False, "persistent": False,
                                                            "compaction": False}):
        with pytest.raises(GateError, match="needs persistent inputs, decode buckets"):
            check_capture_possible(DecodePath(4, 8, 16, cuda, **{**switches, **off}), cuda)


def test_every_graph_writes_one_shared_logits_buffer_and_the_pool_counts_it(ckpt):
    llm = cuda_llm(ckpt, cuda_graphs=True, max_num_seqs=16)
    captured = llm.engine.runner.captured
    rows = max(shape[0] for shape in captured.graphs)
    assert captured.logits.shape == (rows, llm.engine.model_config.vocab_size)
    capture = llm.engine.stats().as_dict()["capture"]
    assert capture["pool_bytes"] >= captured.logits.nbytes  # the emptied-cache measure cannot come out short
    prompts, params = [p for p, _ in MIXED[:5]], [s for _, s in MIXED[:5]]
    assert tokens(llm.generate(prompts, params)) == tokens(cuda_llm(ckpt).generate(prompts, params))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("streamed", [False, True])
def test_capture_and_the_streamed_read_run_on_a_second_device(ckpt, streamed):
    """Capture on cuda:1 while cuda:0 is current: every call names the engine's device."""
    prompts, params = [p for p, _ in MIXED[:5]], [s for _, s in MIXED[:5]]
    want = tokens(cuda_llm(ckpt, streamed_read=streamed, batch_invariant=not streamed).generate(prompts, params))
    torch.cuda.set_device(0)
    llm = make(ckpt, device="cuda:1", dtype="float32", kv_cache_gib=0.05, cuda_graphs=True, max_num_seqs=16,
               streamed_read=streamed, batch_invariant=not streamed)
    assert llm.engine.runner.captured.logits.device == torch.device("cuda:1")
    assert tokens(llm.generate(prompts, params)) == want
    assert llm.engine.stats().as_dict()["capture"]["replays"] > 0
