"""`nanoserve bench ab` on the tiny checkpoint: flag text parsing, verdict arithmetic, and real A/B runs."""

from __future__ import annotations

import argparse
import json

import pytest

from nanoserve.ab import (
    SCHEDULING_B,
    Reply,
    ab_requests,
    first_difference,
    judge,
    parse_overrides,
    parse_value,
    run_ab,
    variant,
)
from nanoserve.bench import ab
from nanoserve.config import EngineConfig, FlagSpec
from nanoserve.errors import ConfigError
from nanoserve.workload import pick_prompts


@pytest.fixture
def base(tiny_checkpoint):
    return EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01, device="cpu")


def test_flag_text_parses_to_typed_overrides():
    assert parse_overrides("max_num_seqs=4  max-num-batched-tokens=64 kv_cache_gib=0.5 max_model_len=") == {
        "max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_gib": 0.5, "max_model_len": None}
    assert parse_overrides("") == {}
    with pytest.raises(ConfigError, match="unknown engine flag 'max_seqs'; known flags: .*max_num_seqs"):
        parse_overrides("max_seqs=4")
    with pytest.raises(ConfigError, match="max_num_seqs must be an integer, got 'four'"):
        parse_overrides("max_num_seqs=four")
    with pytest.raises(ConfigError, match="is not NAME=VALUE"):
        parse_overrides("max_num_seqs")
    with pytest.raises(ConfigError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        variant(EngineConfig(device="cpu"), "max_num_seqs=8 max_num_batched_tokens=4")
    flag = FlagSpec("streamed", bool, False, False, "a future on/off flag", None)
    assert [parse_value(flag, word) for word in ("on", "TRUE", "1", "off", "false", "0")] == [True] * 3 + [False] * 3
    with pytest.raises(ConfigError, match="streamed must be true/false"):
        parse_value(flag, "maybe")


def test_verdict_arithmetic():
    assert first_difference("hello world", "hello world") is None
    assert first_difference("hello world", "hello there") == 6
    assert first_difference("hello", "hello world") == 5  # one is a prefix of the other
    assert first_difference("", "x") == 0
    same = judge(0, {"temperature": 0}, Reply("abc", "length"), Reply("abc", "length"))
    assert same.identical and same.kind == "greedy" and same.label == "identical"
    moved = judge(1, {"temperature": 0.8, "seed": 3}, Reply("abcd", "length"), Reply("abXd", "length"))
    assert (moved.identical, moved.kind, moved.first_difference, moved.label) == (False, "sampled", 2, "differs at 2")
    finish = judge(2, {"temperature": 0}, Reply("abc", "length"), Reply("abc", "stop"))
    assert not finish.identical and finish.first_difference is None and "finish" in finish.label
    failed = judge(3, {"temperature": 0}, Reply("abc", "length"), Reply(error="HTTP 503"))
    assert not failed.identical and "B: HTTP 503" in failed.label


def test_requests_alternate_greedy_and_seeded_sampled():
    bodies = ab_requests(pick_prompts(4), 16, sampled_seed=10)
    assert [b["temperature"] for b in bodies] == [0, 0.8, 0, 0.8]
    assert [b.get("seed") for b in bodies] == [None, 11, None, 13]
    assert all(b["stream"] and b["max_tokens"] == 16 and "messages" in b for b in bodies)


def test_chat_answers_end_where_the_chats_do():
    """A chat prompt stops at the end of its turn, as the console's chat does (no ignore_eos); a raw prompt has
    no turn and runs to max_tokens; ignore_eos=True forces full-length texts (counter checks)."""
    assert not any(b["ignore_eos"] for b in ab_requests(pick_prompts(2), 8))
    assert all(b["ignore_eos"] for b in ab_requests(pick_prompts(2), 8, chat=False))
    assert all(b["ignore_eos"] for b in ab_requests(pick_prompts(2), 8, ignore_eos=True))


def test_another_scheduling_changes_no_text(base):
    result = run_ab(base, variant(base, SCHEDULING_B), ab_requests(pick_prompts(8), 16, ignore_eos=True),
                    concurrency=6)
    assert len(result.verdicts) == 8 and {v.kind for v in result.verdicts} == {"greedy", "sampled"}
    assert all(v.identical for v in result.verdicts), [v.label for v in result.verdicts]
    assert all(len(v.text_a) > 0 and v.finish_a == "length" for v in result.verdicts)
    assert result.crowded and result.a.peak_running >= 2 and result.b.peak_running >= 2
    assert result.b.peak_running <= 4  # B's four row slots held six clients
    assert result.summary().startswith("8/8 identical")
    rows = {name: (a, b) for name, a, b in result.counter_rows()}
    assert rows["flag max_num_seqs"] == (64, 4)
    assert rows["scheduler.generation_tokens_total"] == (8 * 16, 8 * 16)
    assert "latency.step_p50 ms" in rows and "paged_read.mode" in rows
    assert result.a.blocks_held_after_stop == result.b.blocks_held_after_stop == 0


def test_a_different_engine_seed_is_caught_where_the_texts_part(base):
    """The engine seed feeds unseeded sampled requests only: those differ, greedy ones stay identical."""
    greedy = ab_requests(pick_prompts(2), 12)[:1]
    unseeded = [{**greedy[0], "temperature": 1.0, "messages": [{"role": "user", "content": p}]}
                for p in pick_prompts(3)]
    result = run_ab(base, variant(base, "seed=1"), greedy + unseeded, concurrency=4)
    assert result.verdicts[0].identical
    differing = [v for v in result.verdicts if not v.identical]
    assert differing and result.differing == len(differing) and not result.all_identical
    for v in differing:
        n = v.first_difference
        assert n is not None and v.text_a[:n] == v.text_b[:n]
        assert n == min(len(v.text_a), len(v.text_b)) or v.text_a[n] != v.text_b[n]
        assert v.label == f"differs at {n}"
    assert f"{len(differing)} differ" in result.summary()


def bench_ab(argv: list[str]) -> int:
    """`nanoserve bench ab ARGV`, through the module's own add_parser and main (as cli.py registers them)."""
    parser = argparse.ArgumentParser()
    ab.add_parser(parser.add_subparsers())
    return ab.main(parser.parse_args(["ab", *argv]))


def test_cli_writes_its_results(base, tmp_path, capsys):
    flags = ["--model", base.model, "--max-model-len", "256", "--kv-cache-gib", "0.01", "--device", "cpu"]
    code = bench_ab(["--num-prompts", "4", "--concurrency", "4", "--max-tokens", "8",
                     "--b", "max_num_seqs=2 max_num_batched_tokens=32", "--out", str(tmp_path), *flags])
    assert code == 0
    written = json.loads((tmp_path / "ab.json").read_text())
    assert written["all_identical"] and len(written["verdicts"]) == 4
    assert written["peak_running"]["A"] >= 2 and written["peak_running"]["B"] == 2
    assert written["b"]["config"]["max_num_seqs"] == 2 and written["b"]["health_after"]["scheduler"]["steps"] > 0
    assert (tmp_path / "ab.csv").read_text().startswith("index,kind,identical,first_difference")
    out = capsys.readouterr().out
    assert "4/4 identical" in out and "scheduler.generation_tokens_total" in out


def test_cli_refuses_an_uncrowded_run(base, tmp_path, capsys):
    flags = ["--model", base.model, "--max-model-len", "256", "--kv-cache-gib", "0.01", "--device", "cpu"]
    code = bench_ab(["--num-prompts", "2", "--concurrency", "1", "--max-tokens", "2", "--out", str(tmp_path), *flags])
    assert code == 3
    assert "refusing to report: engine A never ran more than 1 request(s) at once" in capsys.readouterr().out
    assert not (tmp_path / "ab.json").exists()
