"""The soak's short version: mixed, hostile traffic with disconnects, a restart and injected step faults, and
nothing lost: no broken response, no 5xx outside the faults, no block held, every admitted request answered."""

from __future__ import annotations

import argparse

from nanoserve import EngineConfig
from nanoserve.bench.soak import clean, soak


def test_a_short_soak_loses_nothing(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02,
                          max_num_seqs=8)
    args = argparse.Namespace(duration=20.0, clients=6, max_tokens=24, restart_flags="max_num_seqs=4",
                              fault_every=97, traffic_seed=1)
    result = soak(config, args)
    assert not clean(result), (clean(result), result)
    outcomes = result["outcomes"]
    assert result["requests_sent"] > 100 and result["faults_injected"] > 0
    for seen in ("disconnected mid-stream", "abandoned before the answer", "hostile: refused as expected"):
        assert outcomes.get(seen, 0) > 0, outcomes
    assert any("injected fault" in k for k in outcomes), outcomes  # the faults reached their clients as errors
    assert result["restart_s"] is not None and result["host"]["admitted"] > 50
