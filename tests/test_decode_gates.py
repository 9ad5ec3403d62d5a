"""Every gate of the decode fast path fails for the reason it exists, and passes when that reason is absent."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.errors import GateError
from nanoserve.runner.decode.buckets import DecodeBuckets, check_capture_budget
from nanoserve.runner.decode.inputs import (
    DecodeInputs,
    check_addresses_stable,
    check_inputs_fit,
    check_one_set_covers,
    check_plan_inputs_persistent,
    check_step_inputs_persistent,
)
from nanoserve.runner.decode.plan import check_plan_current, check_snapshots_present, check_window_intact
from tests.test_engine_crowd import make

CPU = torch.device("cpu")


@pytest.fixture
def decoding(tiny_checkpoint):
    """An engine with three rows past their prefill, persistent inputs on: (engine, its requests)."""
    llm = make(tiny_checkpoint("llama"), persistent_inputs=True, row_compaction=True, decode_buckets=True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"prompt number {i}", SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    return engine, list(engine.scheduler.running)


def plan_for(engine, requests):
    batch, ordered = engine.runner.decode_path.build(requests)
    return engine.runner.decode_path.last_plan, batch, ordered


def test_plan_current_passes_then_catches_a_stale_plan(decoding):
    engine, requests = decoding
    plan, _, ordered = plan_for(engine, requests)
    check_plan_current(plan, ordered)
    engine.step()  # the requests advance one token; the plan does not
    with pytest.raises(GateError, match="the plan is stale"):
        check_plan_current(plan, ordered)


def test_plan_current_catches_a_changed_row_set(decoding):
    engine, requests = decoding
    plan, _, ordered = plan_for(engine, requests)
    with pytest.raises(GateError, match="not this step's decode rows"):
        check_plan_current(plan, ordered[:2])


def test_the_disarmed_witness(decoding):
    """Shared lengths always agree with the present; only the snapshot can show a plan is stale."""
    engine, requests = decoding
    plan, _, ordered = plan_for(engine, requests)
    engine.step()  # the requests advance a token
    plan_for(engine, requests)  # the next plan writes the buffers the held plan's tensors are windows of
    assert plan.context_lens[: plan.rows].tolist() == [r.num_computed + 1 for r in ordered]  # tensor: "current"
    with pytest.raises(GateError, match="stale"):
        check_plan_current(plan, ordered)  # the snapshot knows better
    bare = dataclasses.replace(plan, context_snapshot=None, write_snapshot=None)
    with pytest.raises(GateError, match="carries no snapshots"):
        check_snapshots_present(bare)
    with pytest.raises(GateError, match="carries no snapshots"):
        check_plan_current(bare, ordered)  # refuses rather than trusting the shared tensor
    check_snapshots_present(plan)


def test_window_intact_passes_then_catches_a_table_changed_under_the_plan(decoding):
    engine, requests = decoding
    plan, _, _ = plan_for(engine, requests)
    check_window_intact(plan, engine.config.block_size)
    engine.runner.decode_path.table.table[0, 0] += 1  # the block-table window changes under the plan
    with pytest.raises(GateError, match="changed under the plan"):
        check_window_intact(plan, engine.config.block_size)


def test_addresses_stable_passes_then_catches_a_reallocated_buffer():
    inputs = DecodeInputs(8, CPU)
    recorded = inputs.addresses()
    inputs["positions"].write([1, 2, 3])
    check_addresses_stable(inputs, recorded)
    inputs["positions"].buffer = torch.zeros(8, dtype=torch.int64)  # what `buffer = new tensor` would do
    with pytest.raises(GateError, match=r"\['positions'\] moved"):
        check_addresses_stable(inputs, recorded)


def test_step_and_plan_inputs_persistent(decoding):
    engine, requests = decoding
    plan, batch, _ = plan_for(engine, requests)
    check_step_inputs_persistent(batch, engine.runner.decode_path.inputs)
    check_plan_inputs_persistent(plan, engine.runner.decode_path.inputs)
    fresh = dataclasses.replace(batch, positions=batch.positions.clone())
    with pytest.raises(GateError, match=r"\['positions'\] are fresh tensors"):
        check_step_inputs_persistent(fresh, engine.runner.decode_path.inputs)
    with pytest.raises(GateError, match=r"\['context_lens'\] are not windows"):
        check_plan_inputs_persistent(dataclasses.replace(plan, context_lens=plan.context_lens + 0),
                                     engine.runner.decode_path.inputs)


def test_inputs_fit_and_one_set_covers():
    inputs = DecodeInputs(4, CPU)
    check_inputs_fit(inputs["input_ids"], 4)
    with pytest.raises(GateError, match="5 rows does not fit the 4-row buffer"):
        inputs["input_ids"].write([1, 2, 3, 4, 5])
    check_one_set_covers(inputs, DecodeBuckets(4, 8).shapes)
    with pytest.raises(GateError, match=r"shapes \[\(8, 1\)"):
        check_one_set_covers(inputs, DecodeBuckets(8, 1).shapes)


def test_capture_budget_and_bucket_shapes():
    buckets = DecodeBuckets(max_rows=64, max_blocks=128)
    assert buckets.rows == [1, 2, 4, 8, 16, 32, 64] and buckets.widths == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets.shape_for(3, 5) == (4, 8) and buckets.shape_for(64, 128) == (64, 128)
    assert DecodeBuckets(max_rows=24, max_blocks=3).rows == [1, 2, 4, 8, 16, 24]
    check_capture_budget(buckets, budget=56)
    with pytest.raises(GateError, match="56 decode shapes .* exceed the capture budget of 55"):
        check_capture_budget(buckets, budget=55)
    assert len(DecodeBuckets(64, 128, width_axis=False).shapes) == 7  # a read without a width axis
    with pytest.raises(GateError, match="outside the bucket set"):
        buckets.shape_for(65, 1)


def test_capture_is_refused_without_cuda_with_the_way_out():
    from nanoserve.config import EngineConfig
    from nanoserve.errors import ConfigError

    for flags in ({"cuda_graphs": True}, {"capture_graphs": True, "decode_buckets": True,
                                          "persistent_inputs": True}):
        with pytest.raises(ConfigError, match="needs a CUDA device.*work on the CPU"):
            EngineConfig(device="cpu", **flags)
    with pytest.raises(ConfigError, match="turn on decode_buckets and persistent_inputs"):
        EngineConfig(device="cpu", capture_graphs=True)  # the pairing is checked too


def test_captured_decode_refuses_a_cpu_cache(tiny_checkpoint):
    """Every switch capture needs is on, but the cache is on the CPU (the CUDA-only gate is in test_gpu_capture)."""
    from nanoserve.errors import ConfigError
    from nanoserve.runner.decode.capture import CapturedDecode

    engine = make(tiny_checkpoint("llama"), device="cpu", persistent_inputs=True, row_compaction=True,
                  decode_buckets=True).engine
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        CapturedDecode(engine.runner.model, engine.runner.cache, engine.runner.read, engine.runner.decode_path, heads=4, layers=2)
