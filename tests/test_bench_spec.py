"""`nanoserve bench spec` on a tiny checkpoint: every task runs with speculation off and with each
method, the rows carry
acceptance, and the command passes only because no answer changed."""

from __future__ import annotations

import json

from nanoserve.bench import spec
from nanoserve.cli import main


def test_bench_spec_runs_every_task_both_ways_and_checks_the_bytes(tiny_checkpoint, tmp_path):
    argv = ["bench", "spec", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "512",
            "--kv-cache-gib", "0.05", "--max-tokens", "24", "--repeats", "1", "--skip-llama-cpp",
            "--spec", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
            "--spec", '{"method": "suffix", "num_speculative_tokens": 3}',
            "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "spec.json").read_text())
    rows = {row["task"]: row for row in result["rows"]}
    assert set(rows) == set(spec.TASKS)
    assert all(row["identical"] and row["off_tok_s"] > 0 < row["ngram_tok_s"] and row["suffix_tok_s"] > 0
               for row in rows.values())
    assert result["mixed"]["identical"] and set(result["mixed"]["rates"]) == {"off", "ngram", "suffix"}
    for arm in ("ngram", "suffix"):
        assert sum(c["num_draft_tokens"] for counts in result["counts"].values() for c in counts[arm]) > 0, arm
