"""`nanoserve bench linear` writes one row per (rows, dtype) with self-consistent figures."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_bench_linear_table(tmp_path, capsys):
    assert main(["bench", "linear", "--rows", "1", "4", "--dtypes", "float32", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "linear.json").read_text())
    assert data["stream_gbs"] > 0
    import csv

    rows = list(csv.DictReader((tmp_path / "linear.csv").open()))
    assert [int(r["rows"]) for r in rows] == [1, 4]
    for r in rows:  # fp32: 4 bytes and 2 flops per weight per row, so GFLOPS = GB/s * rows / 2
        expected = float(r["weight_GB_s"]) * int(r["rows"]) / 2
        assert abs(float(r["GFLOPS"]) - expected) < 1e-6 * max(1.0, expected)
    assert "weight_GB_s" in capsys.readouterr().out


def test_bench_linear_times_the_fused_librarys_kernels(tmp_path):
    """The q4x16 / q8x16 arms report the packed bytes (5/8 and 17/16 of a byte a weight) and the same products'
    GFLOPS; an -amx arm runs only where the tiles do."""
    import csv

    from nanoserve.kernels.fused import load

    kernels, why = load()
    if kernels is None:
        import pytest

        pytest.skip(why)
    assert main(["bench", "linear", "--rows", "16", "--dtypes", "float32", "q4x16", "q8x16-amx", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    rows = {r["dtype"]: r for r in csv.DictReader((tmp_path / "linear.csv").open())}
    assert ("q8x16-amx" in rows) == (kernels.tiles == "amx")
    for name, bytes_a_weight in (("q4x16", 5 / 8), ("q8x16-amx", 17 / 16)):
        if name in rows:
            r = rows[name]
            expected = float(r["weight_GB_s"]) / bytes_a_weight * 2 * 16
            assert abs(float(r["GFLOPS"]) - expected) < 1e-6 * expected


def test_each_row_count_is_printed_as_it_completes_before_the_table(tmp_path, capsys):
    """A slow machine shows progress: one line per row count as it is timed, then the table."""
    assert main(["bench", "linear", "--rows", "1", "2", "--dtypes", "float32", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [i for i, line in enumerate(out) if line.startswith(("1 rows:", "2 rows:"))]
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["rows", "dtype"])
    assert len(progress) == 2 and progress[-1] < header


def test_a_slow_cell_is_timed_fewer_times_not_held_to_its_repeats(monkeypatch):
    """Past the cell's time budget the repeats stop; a warm-up over the budget is the measurement itself."""
    from nanoserve.bench import linear

    calls = []
    monkeypatch.setattr(linear, "CELL_BUDGET_S", 1e9)
    linear._best_seconds(lambda: calls.append(1), 3)
    assert len(calls) == 4  # a warm-up and the 3 repeats
    calls.clear()
    monkeypatch.setattr(linear, "CELL_BUDGET_S", 0.0)
    assert linear._best_seconds(lambda: calls.append(1), 3) > 0
    assert len(calls) == 1  # the warm-up alone passed the budget


def test_the_defaults_leave_out_the_gemm_rows_that_take_minutes_on_a_small_cpu():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["bench", "linear"])
    assert max(args.rows) <= 64 and args.repeats <= 3
