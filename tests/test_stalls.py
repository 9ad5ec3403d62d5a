"""Stall detection: a step far above the recent p99 is caught with its composition; ordinary jitter is not."""

from __future__ import annotations

from nanoserve import LLM, SamplingParams
from nanoserve.stalls import MIN_SECONDS, STRETCH_IDS, WARMUP, StallWatch


def test_a_step_far_above_p99_is_a_stall_with_what_it_carried():
    watch = StallWatch()
    for i in range(WARMUP + 40):
        assert not watch.step(0.020 + 0.001 * (i % 5), decode_rows=8, prefill_tokens=0, preemptions=0)
    assert watch.step(0.5, decode_rows=3, prefill_tokens=2048, preemptions=1)
    (stall,) = watch.as_dict()["latest"]
    assert stall["step_ms"] == 500.0 and 20 <= stall["p99_ms"] <= 25
    assert (stall["decode_rows"], stall["prefill_tokens"], stall["preemptions"]) == (3, 2048, 1)
    assert not watch.step(0.03, decode_rows=8, prefill_tokens=0, preemptions=0)  # back to normal
    assert watch.as_dict()["stalls"] == 1


def test_no_stall_before_warmup_or_below_the_floor():
    watch = StallWatch()
    assert not any(watch.step(1.0 if i == 3 else 0.01, 1, 0, 0) for i in range(WARMUP - 1))  # too early to judge
    quiet = StallWatch()
    for _ in range(WARMUP + 1):
        quiet.step(0.0001, 1, 0, 0)
    assert not quiet.step(MIN_SECONDS * 0.9, 1, 0, 0)  # 450x the p99, but under the floor: jitter


class ScriptedClock:
    """The engine's step clock, moved only by the test: a step lasts what its forward says, never what a busy
    machine makes of it, so a threshold test cannot flake on load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_engine_catches_a_slow_step(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01)
    engine = llm.engine
    engine.step_clock = clock = ScriptedClock()
    engine.add_request("a b c", SamplingParams(max_tokens=WARMUP + 20, ignore_eos=True), request_id="r")
    real, calls = engine.runner.model.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        clock.now += 0.3 if calls[0] == WARMUP + 10 else 0.02  # the machine stalls once
        return real(*args, **kwargs)

    engine.runner.model.forward = forward
    while engine.has_unfinished():
        engine.step()
    stalls = engine.stats().as_dict()["stalls"]
    assert stalls["stalls"] == 1
    (slow,) = [s for s in stalls["latest"] if s["kind"] == "step"]
    assert slow["step_ms"] == 300.0 and slow["p99_ms"] == 20.0
    assert slow["decode_rows"] == 1 and slow["prefill_tokens"] == 0


def busy(watch: StallWatch, start: float, seconds: float, step_s: float, rows: int, gap: float = 0.0) -> float:
    """Steps of `step_s` with `gap` between them for `seconds`, each leaving requests running; the end time."""
    now = start
    while now < start + seconds:
        now += gap + step_s
        watch.step(step_s, decode_rows=rows, prefill_tokens=0, preemptions=0, running=rows, now=now)
    return now


def test_throughput_falling_while_the_load_holds_is_a_drop_even_with_fast_steps():
    """Every step takes the usual 20 ms, but the loop waits 60 ms between them (starved of the CPU): decode
    tok/s falls to a quarter with the same 8 rows, and no single step is slow."""
    watch = StallWatch()
    now = busy(watch, 0.0, 10.0, 0.020, rows=8)
    assert watch.as_dict()["throughput_drops"] == 0
    busy(watch, now, 1.5, 0.020, rows=8, gap=0.060)
    stalls = watch.as_dict()
    assert stalls["throughput_drops"] == 1 and stalls["stalls"] == 0
    drop = stalls["latest"][-1]
    assert drop["kind"] == "throughput" and drop["decode_rows"] == 8
    assert 90 <= drop["decode_tok_s"] <= 110 and 390 <= drop["median_tok_s"] <= 410  # 8 / 80 ms and 8 / 20 ms


def test_fewer_requests_or_an_idle_engine_is_not_a_drop():
    watch = StallWatch()
    now = busy(watch, 0.0, 10.0, 0.020, rows=8)
    now = busy(watch, now, 3.0, 0.018, rows=2)  # a quarter of the rows: less throughput, not a stall
    # idle for a minute (no request running), then busy again: the idle time is no one's throughput
    watch.step(0.02, decode_rows=8, prefill_tokens=0, preemptions=0, running=0, now=now + 0.02)
    busy(watch, now + 60.0, 3.0, 0.020, rows=8)
    assert watch.as_dict()["throughput_drops"] == 0


def test_a_slow_steps_entry_names_the_requests_it_carried():
    watch = StallWatch()
    for i in range(WARMUP + 10):
        watch.step(0.020, decode_rows=2, prefill_tokens=0, preemptions=0, requests=("a", "b"), now=0.02 * (i + 1))
    assert watch.step(0.5, decode_rows=2, prefill_tokens=64, preemptions=0, prefill_requests=("c",),
                      requests=("a", "b#1", "c"), now=10.0)
    (stall,) = watch.as_dict()["latest"]
    assert stall["requests"] == ["a", "b#1", "c"] and stall["prefill_requests"] == ["c"]


def test_a_throughput_drops_entry_names_every_request_of_its_stretch():
    """The slow stretch ran r1..r3 in turns (never all in one step): the entry names the union, not the last step's;
    a stretch with more requests than it keeps says it was cut."""
    watch = StallWatch()
    now = busy(watch, 0.0, 10.0, 0.020, rows=8)
    end, turn = now + 1.5, 0
    while now < end:
        now += 0.080
        turn += 1
        watch.step(0.020, decode_rows=8, prefill_tokens=0, preemptions=0, running=8, now=now,
                   requests=(f"r{turn % 3 + 1}",))
    drop = watch.as_dict()["latest"][-1]
    assert drop["kind"] == "throughput" and drop["requests"] == ["r1", "r2", "r3"] and not drop["requests_cut"]

    many = StallWatch()
    now = busy(many, 0.0, 10.0, 0.020, rows=8)
    end, i = now + 1.5, 0
    while now < end:
        now += 0.080
        many.step(0.020, decode_rows=8, prefill_tokens=0, preemptions=0, running=8, now=now,
                  requests=tuple(f"q{i + k}" for k in range(8)))
        i += 8
    drop = many.as_dict()["latest"][-1]
    assert drop["kind"] == "throughput" and drop["requests_cut"] and len(drop["requests"]) == STRETCH_IDS
    first = sorted(int(name[1:]) for name in drop["requests"])
    assert first == list(range(first[0], first[0] + STRETCH_IDS))  # the first seen in the stretch are kept


def test_the_engines_slow_step_names_exactly_the_sequences_it_carried(tiny_checkpoint, monkeypatch):
    """Decode rows (one of them the second completion of an n=2 request, a row of its own in the Requests
    table) and a prefill chunk that arrived just before: the stall entry names each by its table key."""
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.01).engine
    engine.step_clock = clock = ScriptedClock()
    engine.add_request("a b c", SamplingParams(max_tokens=WARMUP + 40, ignore_eos=True), request_id="solo")
    engine.add_request("d e", SamplingParams(max_tokens=WARMUP + 40, ignore_eos=True, n=2), request_id="pair")
    real, carried = engine.runner.execute, []

    def slow_once(sched):
        names = sorted(c.request.name for c in (*sched.decodes, *sched.prefills))
        if "late" in names and not carried:
            carried.append(names)
            clock.now += 0.3  # the machine stalls once
        else:
            clock.now += 0.02
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", slow_once)
    for _ in range(WARMUP + 8):
        engine.step()
    engine.add_request("f g h i", SamplingParams(max_tokens=4, ignore_eos=True), request_id="late")
    engine.step()
    assert carried == [["late", "pair", "pair#1", "solo"]]
    stalls = engine.stats().as_dict()["stalls"]
    (slow,) = [s for s in stalls["latest"] if s["kind"] == "step"]
    assert slow["step_ms"] == 300.0 and sorted(slow["requests"]) == carried[0] and slow["prefill_requests"] == ["late"]
