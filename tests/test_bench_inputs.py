"""`nanoserve bench inputs`: the buffered arm allocates nothing, and the counts follow from the run's shape."""

from __future__ import annotations

import csv
import json

from nanoserve.cli import main


def test_bench_inputs_counts(tmp_path, capsys):
    assert main(["bench", "inputs", "--steps", "8", "40", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "inputs.csv").open()))
    assert [int(r["steps"]) for r in rows] == [8, 40]
    for r in rows:
        steps = int(r["steps"])
        assert int(r["allocations_fresh"]) == 6 * steps  # five inputs and a table rectangle per step
        assert int(r["allocations_buffered"]) == 0
        assert int(r["writes"]) == 4 * steps + 1  # four inputs a step, the logits rows once
        assert int(r["cells"]) == 4 * 3 * steps + 8  # three rows each; the 8 logits rows once
    memory = json.loads((tmp_path / "inputs.json").read_text())["memory"]
    assert memory[0]["bytes"] == 5 * 256 * 8 and memory[2]["bytes"] == 256 * 512 * 8
    assert "input memory" in capsys.readouterr().out
