"""`nanoserve bench prefix` on a tiny checkpoint: both workloads run, the arms agree, and the cache is used."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_bench_prefix_runs_both_workloads_and_the_arms_agree(tiny_checkpoint, tmp_path):
    argv = ["bench", "prefix", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "512",
            "--kv-cache-gib", "0.05", "--turns", "3", "--answer-tokens", "8", "--shared-requests", "6",
            "--system-tokens", "64", "--output-len", "4", "--repeats", "1", "--skip-llama-cpp", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "prefix.json").read_text())
    assert result["identical"] is True
    assert [row["turn"] for row in result["chat"]] == [1, 2, 3]
    assert result["chat"][2]["prompt tokens"] > result["chat"][0]["prompt tokens"]
    on, off = result["shared"]
    assert on["arm"] == "nanoserve cache on" and float(on["prefix hit rate"].rstrip("%")) > 50
    assert off["prefix hit rate"] == "0.0%"
