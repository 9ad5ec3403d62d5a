"""The decode fast path on the CPU: each switch changes where numbers live, never the output; the counters and
the gates say what happened."""

from __future__ import annotations

import itertools

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.runner.decode.inputs import check_addresses_stable, check_step_inputs_persistent
from tests.helpers import cells_changed, counters, decode_step_cells
from tests.test_engine_crowd import BLOCK_BYTES, MIXED, assert_same, make

SWITCHES = ("decode_buckets", "persistent_inputs", "row_compaction")
COMBOS = [dict(zip(SWITCHES, bits)) for bits in itertools.product((False, True), repeat=3) if any(bits)]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def plain(ckpt):
    """The crowd with every switch off: the reference each combination must equal token for token."""
    return make(ckpt).generate([p for p, _ in MIXED], [s for _, s in MIXED])


def verified(llm: LLM) -> LLM:
    llm.engine.runner.decode_path.verify = True  # run check_plan_current and check_window_intact on every plan
    return llm


@pytest.mark.parametrize("flags", COMBOS, ids=lambda f: "+".join(k for k, v in f.items() if v))
def test_every_switch_combination_equals_switches_off(ckpt, plain, flags):
    llm = verified(make(ckpt, **flags))
    crowd = llm.generate([p for p, _ in MIXED], [s for _, s in MIXED])
    assert_same(crowd, plain)
    llm.engine.audit()
    inputs = llm.engine.stats().as_dict()["inputs"]
    assert inputs["steps"] > 20  # the crowd's decode-only steps went through the path
    if flags["persistent_inputs"]:
        assert inputs["fresh_allocations"] == 0 and inputs["sets"] == 1 and inputs["writes"] > 0
        assert inputs["buffered_windows"] == 6 * inputs["steps"]
    else:
        assert inputs["fresh_per_step"] >= 5 and inputs["sets"] == 0
    buckets = llm.engine.stats().as_dict().get("buckets")
    assert (buckets is not None) == flags["decode_buckets"]
    if buckets:
        assert buckets["padded_rows"] > 0  # 10 rows ran in the 16-row bucket


def test_preemption_and_arrivals_with_every_switch(ckpt, plain):
    llm = verified(make(ckpt, kv_cache_gib=17 * BLOCK_BYTES / 2**30, max_num_seqs=10, decode_buckets=True,
                        persistent_inputs=True, row_compaction=True))
    crowd = llm.generate([p for p, _ in MIXED], [s for _, s in MIXED])
    assert llm.engine.stats().scheduler.preemptions > 0
    assert_same(crowd, plain)
    llm.engine.audit()
    assert llm.engine.stats().as_dict()["inputs"]["row_moves"] > 0  # rows left mid-batch and were compacted


def test_long_decode_allocates_no_input_and_never_moves_a_buffer(ckpt):
    llm = verified(make(ckpt, decode_buckets=True, persistent_inputs=True, row_compaction=True))
    engine = llm.engine
    path = engine.runner.decode_path
    addresses, table_address = path.inputs.addresses(), path.table.table.data_ptr()
    for i, n in enumerate((150, 120, 90, 60)):
        engine.add_request(f"row {i} says", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        if path.last_plan is not None and steps < path.stats.steps:
            steps = path.stats.steps
            check_addresses_stable(path.inputs, addresses)
            assert path.table.table.data_ptr() == table_address
    inputs = engine.stats().as_dict()["inputs"]
    assert inputs["steps"] >= 140 and inputs["fresh_allocations"] == 0
    assert inputs["buffered_windows"] == 6 * inputs["steps"] and inputs["sets"] == 1  # 5 inputs + the table


@pytest.mark.parametrize("flags,fresh,windows", [
    ({"decode_buckets": True}, 6, 0),  # every input built for the step
    ({"row_compaction": True}, 5, 1),  # the block table is the slot table's window; the rest are built
    ({"persistent_inputs": True}, 0, 6),
])
def test_input_counters_are_measured_per_step(ckpt, flags, fresh, windows):
    llm = make(ckpt, **flags)
    llm.generate(["one two", "three"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    inputs = llm.engine.stats().as_dict()["inputs"]
    assert inputs["fresh_allocations"] == fresh * inputs["steps"] and inputs["fresh_per_step"] == fresh
    assert inputs["buffered_windows"] == windows * inputs["steps"]


def test_a_buffer_that_moves_shows_as_fresh_allocations(ckpt):
    """The counter is read off the tensors the forward received: a reallocated buffer is caught, though the
    switch is still on (a counter computed from the switch would still say 0)."""
    llm = make(ckpt, persistent_inputs=True)
    path = llm.engine.runner.decode_path
    llm.generate(["warm"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    before = llm.engine.stats().as_dict()["inputs"]
    assert before["fresh_allocations"] == 0
    moved = path.inputs["positions"]
    moved.buffer = moved.staging = moved.buffer.clone()  # a bug that reallocates instead of writing in place
    moved._flat = moved.staging.numpy()
    llm.generate(["again"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    after = llm.engine.stats().as_dict()["inputs"]
    steps = after["steps"] - before["steps"]
    assert steps > 0 and after["fresh_allocations"] == steps  # one fresh input (positions) per step


def test_the_plan_gates_run_in_production_and_a_failure_is_contained(ckpt, monkeypatch):
    import nanoserve.runner.decode.path as path_module
    from nanoserve.engine import StepFailed
    from nanoserve.runner.decode.path import WINDOW_GATE_EVERY

    llm = make(ckpt, persistent_inputs=True, row_compaction=True)  # verify stays off, as in production
    engine = llm.engine
    llm.generate(["a b", "c d e"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    gates = engine.stats().as_dict()["gates"]
    steps = engine.stats().as_dict()["inputs"]["steps"]
    assert gates["plan_current_ran"] == steps and gates["plan_current_failed"] == 0
    assert gates["window_intact_ran"] == -(-steps // WINDOW_GATE_EVERY) and gates["window_intact_every"] == 32
    real = path_module.decode_rows

    def off_by_one(requests, positions, block_size):  # a bug in the addressing: lengths one short
        ids, slots, lens = real(requests, positions, block_size)
        return ids, slots, [n - 1 for n in lens]

    engine.add_request("x y", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="victim")
    engine.step()  # the prefill
    monkeypatch.setattr(path_module, "decode_rows", off_by_one)
    with pytest.raises(StepFailed, match="stale"):
        engine.step()
    monkeypatch.setattr(path_module, "decode_rows", real)
    assert engine.stats().as_dict()["gates"]["plan_current_failed"] == 1
    engine.audit()
    assert llm.generate(["after"], SamplingParams(max_tokens=3))[0].outputs[0].finish_reason == "length"


def test_step_inputs_are_windows_of_the_buffers(ckpt):
    llm = make(ckpt, persistent_inputs=True)
    engine = llm.engine
    engine.add_request("hello there", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # prefill: the general builder
    batch, _ = engine.runner.decode_path.build([r for r in engine.scheduler.running])
    check_step_inputs_persistent(batch, engine.runner.decode_path.inputs)
    assert batch.decode_block_table.data_ptr() == engine.runner.decode_path.table.table.data_ptr()


def test_stats_sections_absent_while_off(ckpt):
    stats = make(ckpt).engine.stats().as_dict()
    assert "inputs" not in stats and "buckets" not in stats


def test_flags_reach_the_cli():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["generate", "x", "--persistent-inputs", "--decode-buckets", "--row-compaction"])
    assert args.persistent_inputs and args.decode_buckets and args.row_compaction
    assert not build_parser().parse_args(["generate", "x"]).persistent_inputs


def test_padded_rows_touch_only_the_null_block(ckpt):
    """Three rows in a four-row bucket: the padded row writes block 0 and nothing else moves."""
    llm = make(ckpt, decode_buckets=True, persistent_inputs=True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"prompt {i}", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the three prefills
    k, v = engine.runner.cache.k.clone(), engine.runner.cache.v.clone()
    engine.step()  # one decode-only step: 3 rows padded to 4
    plan, running = engine.runner.decode_path.last_plan, list(engine.scheduler.running)
    assert (plan.rows, plan.shape[0]) == (3, 4) and len(running) == 3
    # exactly each row's new token in its own block, and the padded row's slot 0 of the null block, in every layer
    want = decode_step_cells(running, engine.config.block_size, padded=True, layers=engine.runner.cache.k.shape[0])
    assert cells_changed(engine.runner.cache.k, k, engine.runner.cache.layout, keys=True) == want
    assert cells_changed(engine.runner.cache.v, v, engine.runner.cache.layout) == want


def test_sections_reach_metrics(ckpt):
    from nanoserve.server.metrics import Metrics

    llm = make(ckpt, persistent_inputs=True, decode_buckets=True)
    llm.generate(["a b c"], SamplingParams(max_tokens=5, ignore_eos=True))
    text = Metrics(llm.engine.stats, "tiny").render().decode()
    assert 'nanoserve:inputs_fresh_allocations{model_name="tiny"} 0.0' in text
    assert 'nanoserve:inputs_steps{model_name="tiny"} 4.0' in text
    assert "nanoserve:buckets_shapes" in text
    assert "nanoserve:inputs_persistent" not in text  # booleans are not gauges
    plain = Metrics(make(ckpt).engine.stats, "tiny").render().decode()
    assert "nanoserve:inputs_" not in plain


def test_two_live_servers_switches_off_and_on_send_identical_bytes(ckpt):
    """Through the OpenAI API: six clients, greedy and seeded, one server plain and one with every switch."""
    from nanoserve.ab import ab_requests, run_ab, variant
    from nanoserve.config import EngineConfig
    from nanoserve.workload import pick_prompts

    base = EngineConfig(model=str(ckpt), max_model_len=256, kv_cache_gib=0.01, device="cpu", max_num_seqs=4)
    switched = variant(base, "decode_buckets=on persistent_inputs=on row_compaction=on")
    result = run_ab(base, switched, ab_requests(pick_prompts(8), 24), concurrency=6)
    assert result.all_identical, [v.label for v in result.verdicts]
    assert result.crowded and result.b.peak_running >= 2
    rows = counters(result)
    assert rows["inputs.fresh_allocations"][1] == 0 and rows["inputs.steps"][1] > 0
