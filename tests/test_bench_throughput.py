"""`nanoserve bench throughput`, the source of the README's headline figures, on a tiny 4-bit GGUF file: its
table's columns, the JSON it writes, and each peer's arm (transformers always; llama.cpp where
llama-cpp-python is installed, which the quick-start install and CI leave out: it builds from source)."""

from __future__ import annotations

import csv
import json

import pytest

from nanoserve.cli import main
from nanoserve.kernels.build import find_compiler
from tests.gguf_fixtures import byte_level_vocab, hf_weights, write_llama_gguf
from tests.without_optional import hidden_run

COLUMNS = ["arm", "mixed_tok_s", "mixed_seconds", "output_tokens", "rows_at_once", "single_tok_s",
           "single_share_of_bound", "peak_rss_mib"]
# the same engine on eager torch ops, beside one on the fused CPU kernels (which run wherever a C compiler does)
EAGER = ["nanoserve --no-fused-cpu-kernels"] if find_compiler() else []
BUDGET_OFF = "nanoserve --max-step-ms 0"  # the step-time budget off: what smooth streams cost the workload
WORKLOAD = ["--num-requests", "4", "--prompt-len", "8", "16", "--output-len", "4", "8", "--single-tokens", "8",
            "--repeats", "2", "--hf-batch", "2", "--max-model-len", "128", "--kv-cache-gib", "0.01"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny-q4.gguf"
    return write_llama_gguf(path, hf_weights(len(byte_level_vocab()[0])), qtype="Q4_0")


def run_bench(argv: list[str], out) -> tuple[list[dict], dict]:
    assert main(["bench", "throughput", *argv, "--out", str(out)]) == 0
    return read_results(out)


def read_results(out) -> tuple[list[dict], dict]:
    with open(out / "throughput.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    return rows, json.loads((out / "throughput.json").read_text())


def check_arms(rows: list[dict], result: dict, arms: list[str]) -> None:
    """Every arm served the whole workload (the same output tokens) and has a single-stream median."""
    assert [row["arm"] for row in rows] == arms
    assert list(result["mixed"]) == arms
    tokens = {int(row["output_tokens"]) for row in rows}
    assert len(tokens) == 1 and 16 <= tokens.pop() <= 32  # 4 requests of 4-8 tokens each
    for row in rows:
        assert float(row["mixed_tok_s"]) > 0 and float(row["single_tok_s"]) > 0
        assert len(result["single_runs"][row["arm"]]) == 2  # --repeats
        assert float(row["peak_rss_mib"]) == result["peak_rss_mib_by_arm"][row["arm"]] > 0
    assert result["peak_rss_over_engine"] > 0
    assert {"cpu", "cpu_flags", "threads", "torch"} <= set(result["machine"])


def test_bench_throughput_puts_nanoserve_its_dense_self_and_transformers_in_one_table(tiny_gguf, tmp_path, capsys):
    rows, result = run_bench(["--model", str(tiny_gguf), *WORKLOAD, "--skip-llama-cpp"], tmp_path)
    check_arms(rows, result, ["nanoserve", "nanoserve --no-batch-invariant", BUDGET_OFF, *EAGER, "nanoserve dense",
                              "transformers"])
    assert result["linear"]["format"] == ("q4x8" if EAGER else "int4")  # Q4_0 on the fused library where it runs
    peers = ("nanoserve_no_batch_invariant", "nanoserve_max_step_ms_0",
             *(["nanoserve_no_fused_cpu_kernels"] if EAGER else []),
             "nanoserve_dense", "transformers")
    assert set(result["ratios"]) == {f"{kind}_vs_{arm}" for kind in ("mixed", "single") for arm in peers}
    printed = capsys.readouterr().out.splitlines()
    header = next(line for line in printed if line.split()[:1] == ["arm"])
    assert header.split() == COLUMNS


def test_bench_throughput_runs_llama_cpp_on_the_same_file(tiny_gguf, tmp_path):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install 'nanoserve[peers]'), so llama.cpp's "
                            "arm is not checked here")
    rows, result = run_bench(["--model", str(tiny_gguf), *WORKLOAD, "--skip-hf"], tmp_path)
    check_arms(rows, result, ["nanoserve", "nanoserve --no-batch-invariant", BUDGET_OFF, *EAGER, "nanoserve dense", "llama.cpp"])
    assert result["llama_cpp_python"] == llama_cpp.__version__
    assert {"mixed_vs_llamacpp", "single_vs_llamacpp"} <= set(result["ratios"])


def test_bench_throughput_from_the_quick_start_install_leaves_the_peers_out_and_says_how(runtime_modules, tiny_gguf,
                                                                                      tmp_path):
    run = hidden_run(runtime_modules, "cli", "bench", "throughput", "--model", str(tiny_gguf), *WORKLOAD,
                     "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "transformers arm left out: transformers is not installed (pip install 'nanoserve[hf]'" in run.stdout
    assert "llama.cpp arm left out: llama-cpp-python is not installed (pip install 'nanoserve[peers]'" in run.stdout
    rows, result = read_results(tmp_path)
    check_arms(rows, result, ["nanoserve", "nanoserve --no-batch-invariant", BUDGET_OFF, *EAGER, "nanoserve dense"])


def test_bench_throughput_measures_determinism_from_either_side(tiny_gguf, tmp_path):
    """Run without batch invariance, the arm beside it is the batch-invariant engine, and the other way round;
    --skip-invariance-arm leaves it out, --skip-budget-arm the one without the step-time budget, and
    --skip-eager-arm the one on eager torch ops."""
    rows, result = run_bench(["--model", str(tiny_gguf), *WORKLOAD, "--skip-hf", "--skip-llama-cpp",
                              "--no-batch-invariant"], tmp_path)
    check_arms(rows, result, ["nanoserve", "nanoserve --batch-invariant", BUDGET_OFF, *EAGER, "nanoserve dense"])
    assert result["flags"]["batch_invariant"] is False
    assert {"mixed_vs_nanoserve_batch_invariant", "single_vs_nanoserve_batch_invariant"} <= set(result["ratios"])
    rows, _ = run_bench(["--model", str(tiny_gguf), *WORKLOAD, "--skip-hf", "--skip-llama-cpp",
                         "--skip-invariance-arm"], tmp_path)
    assert [row["arm"] for row in rows] == ["nanoserve", BUDGET_OFF, *EAGER, "nanoserve dense"]
    rows, _ = run_bench(["--model", str(tiny_gguf), *WORKLOAD, "--skip-hf", "--skip-llama-cpp",
                         "--skip-invariance-arm", "--skip-budget-arm", "--skip-eager-arm"], tmp_path)
    assert [row["arm"] for row in rows] == ["nanoserve", "nanoserve dense"]


def test_an_arm_is_freed_before_the_next_and_its_peak_is_its_own():
    """run_arm holds an arm only while it runs: the resident memory it took is given back, and its sampled peak
    shows it (the process's own high-water mark could not tell one arm from the next)."""
    import argparse

    import torch

    from nanoserve.bench.memory import trimmed_resident_mib
    from nanoserve.bench.throughput import run_arm

    class Arm:  # holds 256 MiB, as a model would
        def __init__(self):
            self.weights = torch.ones(64 * 2**20)

        def single(self, prompt, n):
            return 1.0

        def mixed(self, work):
            return {"tok_s": 1.0}

        def close(self):
            self.weights = None

    before = trimmed_resident_mib()
    result = run_arm("fake", argparse.Namespace(repeats=2, single_tokens=4), Arm, lambda arm: ([], [1]))
    assert result.single == [1.0, 1.0]
    assert result.peak_rss_mib - before > 200  # it saw the arm's 256 MiB
    assert trimmed_resident_mib() - before < 64  # and the arm's memory went back before the next arm
