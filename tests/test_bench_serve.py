"""`nanoserve bench serve` on a tiny checkpoint: the figures add up, and an uncrowded arm is refused."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_bench_serve_reports_a_crowded_arm(tiny_checkpoint, tmp_path, capsys):
    flags = ["--model", str(tiny_checkpoint("llama")), "--max-model-len", "256", "--kv-cache-gib", "0.01"]
    code = main(["bench", "serve", "--num-prompts", "8", "--concurrency", "4", "--output-len", "24",
                 "--out", str(tmp_path), *flags])
    assert code == 0
    result = json.loads((tmp_path / "serve.json").read_text())["result"]
    assert result["successful"] == 8 and result["failed"] == 0
    assert result["peak_running_seen"] >= 2
    assert abs(result["output_tok_per_s"] * result["duration_s"] - 8 * 24) < 1e-6
    for name in ("ttft", "tpot", "itl"):
        assert 0 < result[f"{name}_median_ms"] <= result[f"{name}_p99_ms"]
    assert "output_tok_per_s" in capsys.readouterr().out


def test_bench_serve_refuses_an_uncrowded_arm(tiny_checkpoint, tmp_path, capsys):
    flags = ["--model", str(tiny_checkpoint("llama")), "--max-model-len", "256", "--kv-cache-gib", "0.01"]
    code = main(["bench", "serve", "--num-prompts", "2", "--concurrency", "2", "--output-len", "2",
                 "--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--out", str(tmp_path), *flags])
    assert code == 3
    assert "refusing to report" in capsys.readouterr().out
    assert not (tmp_path / "serve.json").exists()
