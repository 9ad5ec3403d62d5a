"""`nanoserve bench prefill` on a tiny checkpoint: both tables fill, every workload continues a sequence, and
the two reads give close first tokens."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_bench_prefill_runs_both_reads_on_every_workload(tiny_checkpoint, tmp_path):
    argv = ["bench", "prefill", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "512",
            "--kv-cache-gib", "0.05", "--max-num-batched-tokens", "64", "--long-tokens", "200",
            "--history-tokens", "96", "--turn-tokens", "8", "--crowd", "4", "--system-tokens", "48",
            "--question-tokens", "4", "--layer-grid", "32x8", "--no-llama-8b", "--repeats", "1",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "prefill.json").read_text())
    assert [(row["past"], row["chunk"]) for row in result["layers"]] == [(32, 8)]
    assert len(result["engine"]) == 3 and all(row["split ms"] > 0 < row["masked ms"] for row in result["engine"])
    assert result["first_tokens"]["not close"] == 0
    assert sum(result["first_tokens"].values()) == 1 + 1 + 4
