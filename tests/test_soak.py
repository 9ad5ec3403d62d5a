"""The soak's short version: mixed, hostile traffic with disconnects, a restart and injected step faults, and
nothing lost: no broken response, no 5xx outside the faults, no block held, every admitted request answered."""

from __future__ import annotations

from nanoserve import EngineConfig
from nanoserve.bench.soak import clean, soak
from nanoserve.cli import build_parser


def test_a_short_soak_loses_nothing(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02,
                          max_num_seqs=8)
    args = build_parser().parse_args(["bench", "soak", "--duration", "20", "--clients", "6", "--max-tokens", "24",
                                      "--restart-flags", "max_num_seqs=4", "--fault-every", "97",
                                      "--traffic-seed", "1", "--no-attacks"])
    result = soak(config, args)
    assert not clean(result), (clean(result), result)
    outcomes = result["outcomes"]
    assert result["requests_sent"] > 100 and result["faults_injected"] > 0
    for seen in ("disconnected mid-stream", "abandoned before the answer", "hostile: refused as expected"):
        assert outcomes.get(seen, 0) > 0, outcomes
    assert any("injected fault" in k for k in outcomes), outcomes  # the faults reached their clients as errors
    assert result["restart_s"] is not None and result["host"]["admitted"] > 50


def test_the_soak_injects_faults_by_default_as_the_readme_says():
    """`nanoserve bench soak` alone fails one forward in FAULT_EVERY; --fault-every 0 turns it off."""
    from types import SimpleNamespace

    from nanoserve.bench.soak import FAULT_EVERY
    from nanoserve.bench.soak_server import FaultInjector

    assert build_parser().parse_args(["bench", "soak"]).fault_every == FAULT_EVERY > 0
    assert build_parser().parse_args(["bench", "soak", "--fault-every", "0"]).fault_every == 0
    engine = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(forward=lambda: "ok")))
    faults = FaultInjector(FAULT_EVERY)
    faults.install(engine)
    failed = 0
    for _ in range(2 * FAULT_EVERY):
        try:
            engine.runner.model.forward()
        except RuntimeError as e:
            assert "injected fault" in str(e)
            failed += 1
    assert failed == faults.injected == 2


QUIET = {"broken": [], "outcomes": {}, "five_xx_not_on_purpose": 0, "blocks_held_at_end": 0, "unanswered": 0,
         "health_failures": 0, "engine_leftovers": {}, "host": {"live": 0, "dropped": 0}, "fault_every": 0,
         "faults_injected": 0, "duration_s": 300.0, "replicas_ready": None, "data_parallel_size": 1,
         "rss_mib": [(0.0, 500.0), (60.0, 1000.0), (120.0, 1050.0), (300.0, 1090.0)]}


def test_memory_is_held_to_its_value_after_the_first_minute():
    """The first minute's growth (caches, pools, compiled kernels) is free; past it, 10% is the bound."""
    assert not clean(QUIET)
    grown = {**QUIET, "rss_mib": [*QUIET["rss_mib"][:-1], (300.0, 1120.0)]}
    assert any("resident memory grew from 1,000 MiB (warm) to 1,120 MiB" in p for p in clean(grown))


def test_a_data_parallel_soak_with_a_replica_down_at_the_end_is_not_clean():
    assert any("only 1 of 2 replicas ready" in p for p in clean({**QUIET, "replicas_ready": 1,
                                                                 "data_parallel_size": 2}))


def test_a_soak_asked_for_faults_that_injected_none_is_not_clean():
    result = {**QUIET, "fault_every": 500, "faults_injected": 0}
    assert any("no fault was injected" in p and "--duration" in p for p in clean(result))
    assert not clean({**result, "fault_every": 0})
    assert not clean({**result, "faults_injected": 1})
