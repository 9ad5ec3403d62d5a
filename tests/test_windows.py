"""Sliding windows: what the last 10 s, 1 min and 5 min saw, measured from the engine's own events."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams
from nanoserve.windows import RecentActivity


def test_each_window_holds_only_its_own_span():
    recent = RecentActivity()
    recent.latency("ttft", 1.0, now=-10.0)  # more than five minutes before the last: dropped
    recent.latency("ttft", 0.5, now=200.0)  # in 5m only
    recent.latency("ttft", 0.2, now=295.0)  # in 1m and 5m
    recent.latency("ttft", 0.1, now=299.0)  # in all three
    for t in range(290, 300):
        recent.finished("stop", now=float(t))
    recent.finished("abort", now=299.5)
    windows = recent.snapshot(now=300.0, started=-20.0)
    assert windows["10s"]["ttft_p50_ms"] == 100.0 and windows["10s"]["ttft_p99_ms"] == 200.0
    assert windows["1m"]["ttft_p99_ms"] == 200.0 and windows["5m"]["ttft_p99_ms"] == 500.0
    assert windows["10s"]["finished_per_s"] == {"abort": 0.1, "stop": 1.0}
    assert windows["5m"]["finished_per_s"]["stop"] == round(10 / 300, 3)
    assert windows["10s"]["step_p50_ms"] is None  # nothing stepped


def test_a_window_longer_than_the_uptime_is_measured_over_the_uptime():
    recent = RecentActivity()
    for t in range(5):
        recent.finished("length", now=100.0 + t)
    windows = recent.snapshot(now=105.0, started=100.0)
    assert windows["5m"]["seconds"] == 5.0 and windows["5m"]["finished_per_s"] == {"length": 1.0}


def test_the_engine_publishes_its_windows(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request("d", SamplingParams(max_tokens=50), request_id="gone")
    engine.step()
    engine.abort("gone")
    while engine.has_unfinished():
        engine.step()
    windows = engine.stats().as_dict()["windows"]
    assert set(windows) == {"10s", "1m", "5m"}
    recent = windows["10s"]
    assert recent["ttft_p50_ms"] > 0 and recent["tpot_p99_ms"] > 0 and recent["step_p99_ms"] > 0
    assert recent["finished_per_s"]["length"] > 0 and recent["finished_per_s"]["abort"] > 0


def test_the_windows_are_worked_out_at_most_once_a_second():
    """The host snapshots after every step on the engine thread: the windows must not be re-sorted each time."""
    recent = RecentActivity()
    recent.latency("step", 0.010, now=100.0)
    first = recent.snapshot(now=100.0, started=0.0)
    recent.latency("step", 0.900, now=100.5)
    assert recent.snapshot(now=100.5, started=0.0) is first  # within the second: the same answer
    later = recent.snapshot(now=101.0, started=0.0)
    assert later["10s"]["step_p99_ms"] == 900.0
