"""`nanoserve bench grammar` on a tiny checkpoint: both tables fill, and the constrained arm really was masked."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_bench_grammar_measures_compiles_masks_and_steps(tiny_checkpoint, tmp_path):
    argv = ["bench", "grammar", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "128",
            "--kv-cache-gib", "0.02", "--rows", "1", "4", "--steps", "6", "--compiles", "2", "--repeats", "2",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "grammar.json").read_text())
    llg = [row for row in result["compile"] if row["backend"] == "llguidance"]
    assert len(llg) == 2 and all(row["compile ms (median)"] > 0 and row["tokens walked"] > 5 for row in llg)
    assert [row["rows"] for row in result["steps"]] == [1, 4]
    for row in result["steps"]:
        assert row["steps timed"] >= 2 * 4 and row["mask ms per step"] > 0
