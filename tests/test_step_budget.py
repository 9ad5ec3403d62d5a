"""The step-time budget: a long prompt arriving beside a running stream is read over steps that fit a target time
(nanoserve/step_budget.py), an idle server still prefills with the whole token budget, and the chunk boundaries
timing chooses change no output."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.kv.manager import KVManager
from nanoserve.request import Request
from nanoserve.scheduler import Scheduler
from nanoserve.step_budget import DECODE_MULTIPLE, FIRST_CHUNK, StepBudget

from .helpers import wait_until


def _request(name: str, prompt_len: int, max_tokens: int = 50) -> Request:
    return Request(name, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def _run(sched: Scheduler, out) -> None:
    """What a step's result does to the scheduler: every completing row gets token 7."""
    done = [c.request for c in (*out.decodes, *out.prefills) if c.completes]
    sched.update_from_output(out, SimpleNamespace(sampled=done, token_ids=[7] * len(done)))


def _scheduler(max_step_ms: float | None, tokens: int = 2048) -> tuple[Scheduler, StepBudget]:
    budget = StepBudget(max_step_ms, block_size=16)
    return Scheduler(KVManager(512, 16), max_num_seqs=8, max_num_batched_tokens=tokens, step_budget=budget), budget


def test_an_idle_server_prefills_with_the_whole_token_budget():
    sched, budget = _scheduler(None)
    budget.observe(decode_rows=1, prefill_tokens=0, seconds=0.030)  # costs known: they must not matter here
    budget.observe(decode_rows=0, prefill_tokens=1000, seconds=2.0)
    sched.add(_request("long", 1750))
    out = sched.schedule()
    assert [c.length for c in out.prefills] == [1750] and not out.cut_by_time


def test_beside_a_stream_a_long_prompt_is_read_in_chunks_that_fit_the_target():
    """Scripted costs: a decode step 1/32 s, a prefill token beside it 1/4096 s. The auto target is then 4 decode
    steps, 125 ms; 0.9 of it less the decode leaves 81.25 ms, 332 tokens: a long chunk, cut to the block boundary
    inside it."""
    sched, budget = _scheduler(None)
    sched.add(_request("stream", 8))
    _run(sched, sched.schedule())  # the stream's prompt, alone: the whole prompt
    budget.observe(decode_rows=1, prefill_tokens=0, seconds=1 / 32)
    sched.add(_request("long", 1750))
    out = sched.schedule()
    assert len(out.decodes) == 1 and [c.length for c in out.prefills] == [FIRST_CHUNK]  # no prefill timed yet
    assert out.cut_by_time
    _run(sched, out)
    budget.observe(decode_rows=1, prefill_tokens=FIRST_CHUNK, seconds=1 / 32 + FIRST_CHUNK / 4096, cut=True)
    assert budget.target_s() == pytest.approx(DECODE_MULTIPLE / 32)
    sizes = []
    for _ in range(4):
        out = sched.schedule()
        (chunk,) = out.prefills
        assert (chunk.start + chunk.length) % 16 == 0  # the prefix cache names every block it filled
        sizes.append(chunk.length)
        _run(sched, out)
        budget.observe(decode_rows=1, prefill_tokens=chunk.length, seconds=1 / 32 + chunk.length / 4096,
                       cut=out.cut_by_time)
    assert sizes == [320] * 4  # 32 + 332 = 364 ends in the block that starts at 352
    assert budget.as_dict()["limited_steps"] == 5 and budget.as_dict()["prefill_limit_tokens"] == 332


@pytest.mark.parametrize("decode_rows, token_s, chunk", [(1, 1 / 512, 31), (3, 1 / 512, 29), (1, 1 / 64, 15),
                                                         (16, 1 / 512, 32)])
def test_where_the_linears_run_on_tiles_a_step_fills_whole_tiles(decode_rows, token_s, chunk):
    """A tile holds 16 rows and the last is padded: a step's decode rows and prefill tokens together fill whole
    tiles (one decode row beside 31 tokens, not 41; at least the first tile's rest, 15, when fewer fit)."""
    budget = StepBudget(None, block_size=16, row_quantum=16)
    sched = Scheduler(KVManager(512, 16), max_num_seqs=20, max_num_batched_tokens=2048, step_budget=budget)
    for i in range(decode_rows):
        sched.add(_request(f"stream-{i}", 8))
    _run(sched, sched.schedule())
    budget.observe(decode_rows=decode_rows, prefill_tokens=0, seconds=1 / 32)
    budget.observe(decode_rows=decode_rows, prefill_tokens=64, seconds=1 / 32 + 64 * token_s)
    sched.add(_request("long", 1750))
    out = sched.schedule()
    (prefill,) = out.prefills
    assert len(out.decodes) == decode_rows and prefill.length == chunk and out.cut_by_time
    assert (decode_rows + chunk) % 16 == 0


def test_the_flag_sets_the_target_and_zero_turns_the_budget_off():
    sched, budget = _scheduler(600)
    sched.add(_request("stream", 8))
    _run(sched, sched.schedule())
    budget.observe(decode_rows=1, prefill_tokens=0, seconds=0.030)
    budget.observe(decode_rows=1, prefill_tokens=100, seconds=0.030 + 0.2)
    sched.add(_request("long", 1750))
    (chunk,) = sched.schedule().prefills
    assert chunk.length == 240  # 0.9 x 600 ms - 30 ms = 510 ms at 2 ms a token: 255, to its last block: 240
    off, off_budget = _scheduler(0)
    off.add(_request("stream", 8))
    _run(off, off.schedule())
    off_budget.observe(decode_rows=1, prefill_tokens=0, seconds=0.030)
    off.add(_request("long", 1750))
    assert [c.length for c in off.schedule().prefills] == [1750]


def test_only_a_streamed_row_holds_prefill_to_the_budget():
    """A request answered at its end (offline generate, a non-streaming HTTP request) wants throughput: decode
    rows of such requests leave the long prompt its whole token budget."""
    sched, budget = _scheduler(None)
    batch = _request("batch", 8)
    batch.streamed = False
    sched.add(batch)
    _run(sched, sched.schedule())
    budget.observe(decode_rows=1, prefill_tokens=0, seconds=0.030)
    budget.observe(decode_rows=1, prefill_tokens=100, seconds=0.230)
    sched.add(_request("long", 1750))
    out = sched.schedule()
    assert len(out.decodes) == 1 and [c.length for c in out.prefills] == [1750] and not out.cut_by_time


def test_offline_generate_is_answered_at_the_end_so_its_rows_are_not_streams(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    engine = llm.engine
    seen = []
    step = engine.step

    def watching():
        seen.extend(r.streamed for r in engine.scheduler.running)
        return step()

    engine.step = watching
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert seen and not any(seen)


def test_a_step_past_its_target_is_counted_with_the_prompt_it_read():
    budget = StepBudget(None, 16)
    budget.observe(decode_rows=1, prefill_tokens=0, seconds=0.030)
    assert budget.observe(decode_rows=1, prefill_tokens=512, seconds=1.5, prefill_requests=("req-9",))
    assert not budget.observe(decode_rows=0, prefill_tokens=2048, seconds=4.0)  # no stream waited on this one
    section = budget.as_dict()
    assert section["steps_over_target"] == 1 and section["latest_over"][0]["prefill_requests"] == ["req-9"]


def _answers(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, tuple]:
    """A stream starts alone; three steps later the long prompts arrive beside it (as a server would see them)."""
    engine, done = llm.engine, {}
    engine.add_request(prompts[0], params, request_id="stream")
    for _ in range(3):
        engine.step()
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(prompt, params, request_id=f"long-{i}")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    return done


def test_chunks_sized_by_timing_change_no_output(tiny_checkpoint, monkeypatch):
    """Chunk sizes that vary from step to step (random prefill limits, as timing would give) against the same
    prompts read whole: the same tokens and the same logprobs, bit for bit."""
    path = str(tiny_checkpoint("llama"))
    whole = LLM(model=path, max_model_len=512, kv_cache_gib=0.02, max_step_ms=0, enable_prefix_caching=False)
    timed = LLM(model=path, max_model_len=512, kv_cache_gib=0.02, enable_prefix_caching=False)
    rng = random.Random(3)
    monkeypatch.setattr(timed.engine.step_budget, "prefill_limit",
                        lambda rows, left, decodes=None: left if rows == 0 else min(left, rng.randrange(1, 70)))
    prompts = [[(i * 37 + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 300, 170, 41, 260))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    a, b = _answers(whole, prompts, params), _answers(timed, prompts, params)
    assert timed.engine.step_budget.limited_steps >= 10 and whole.engine.step_budget.limited_steps == 0
    assert a == b


def test_a_live_stream_keeps_flowing_while_a_long_prompt_is_read():
    """The default model on a live server: a stream is running when a 1,750-token prompt arrives. Read in one
    step (the token budget alone) it would hold the stream for its whole prefill; under the step-time budget the
    stream's longest gap is a small share of that prompt's time to first token, and the server says it cut."""
    import httpx

    from nanoserve import EngineConfig
    from nanoserve.bench.budget import stream_gaps
    from nanoserve.server.serve import Server

    server = Server(EngineConfig(max_model_len=2048, kv_cache_gib=0.25), port=0, served_model_name="default").start()
    try:
        arrived, gaps = threading.Event(), []
        stream = threading.Thread(target=stream_gaps, args=(server.url, 90, arrived, gaps, []),
                                  kwargs={"model": "default"})
        stream.start()
        assert wait_until(lambda: httpx.get(server.url + "/health").json()["scheduler"]["generation_tokens_total"]
                          >= 10, timeout=60)
        long_prompt = [(i * 7919) % 40000 + 100 for i in range(1750)]
        arrived.set()
        started = time.perf_counter()
        answer = httpx.post(server.url + "/v1/completions", timeout=120,
                            json={"model": "default", "prompt": long_prompt, "max_tokens": 1}).json()
        ttft = time.perf_counter() - started
        stream.join(timeout=120)
        budget = httpx.get(server.url + "/health").json()["step_budget"]
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert answer["usage"]["prompt_tokens"] == 1750
    assert budget["limited_steps"] >= 3, budget  # the prompt was read over several steps beside the stream
    assert gaps and max(gaps) < ttft / 3, (max(gaps), ttft, budget)
    assert "nanoserve:step_budget_target_ms" in metrics and "nanoserve:step_budget_limited_steps" in metrics
