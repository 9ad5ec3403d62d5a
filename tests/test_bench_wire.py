"""`nanoserve bench wire`: both reads agree, and the counters follow from the run's shapes."""

from __future__ import annotations

import csv
import json

from nanoserve.cli import main


def test_bench_wire_counts(tmp_path):
    assert main(["bench", "wire", "--rows", "2", "--blocks", "16", "--steps", "20", "--out", str(tmp_path)]) == 0
    (row,) = list(csv.DictReader((tmp_path / "wire.csv").open()))
    assert row["same"] == "yes" and int(row["reads"]) == 20
    widths = [-(-(16 + s + 1) // 16) * 16 for s in range(20)]  # the table window's cells each step
    assert int(row["charged"]) == sum(2 * 8 * w for w in widths) == int(row["gathered_held"])
    assert int(row["held"]) == 20 * 2 * 8 * 16  # one 16-token tile per row and head
    assert abs(float(row["saving"]) - int(row["charged"]) / int(row["held"])) < 1e-9
    shapes = json.loads((tmp_path / "wire.json").read_text())["shapes"]
    assert shapes[1] == {"max_num_seqs": 256, "max_model_len": 8192, "gathered_shapes": 90, "streamed_shapes": 9}
