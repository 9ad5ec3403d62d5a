"""Request timelines (nanoserve/timeline.py): each sequence's spans, checked against the engine's own steps as a
wrapper around Engine.step saw them (what was scheduled, the rows each step shared, the preemptions)."""

from __future__ import annotations

import time

from nanoserve import LLM, SamplingParams
from nanoserve.timeline import TimelineRecorder

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32


def _watch(engine) -> list[dict]:
    """Each step's schedule as the engine ran it: serial -> ("prefill", tokens, start) / ("decode", rows)."""
    steps, schedule = [], engine.scheduler.schedule

    def watching():
        sched = schedule()
        rows = len(sched.decodes)
        steps.append({"prefill": {c.request.serial: (c.length, c.start) for c in sched.prefills},
                      "decode": {c.request.serial: rows for c in sched.decodes},
                      "preempted": [r.serial for r in sched.preempted]})
        return sched

    engine.scheduler.schedule = watching
    return steps


def test_each_sequence_has_its_chunks_cached_tokens_decode_steps_and_finish_as_the_steps_ran(tiny_checkpoint):
    """A long prompt chunked by a small token budget, beside short ones decoding: every prefill chunk, every
    decode step and the rows it shared appear in the sequence's timeline, in order, and nothing else does."""
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_gib=0.02, max_num_batched_tokens=64)
    engine = llm.engine
    steps = _watch(engine)
    prompts = [[5 + i % 50 for i in range(150)], [7, 8, 9], [11, 12, 13, 14]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    rows = {r["request_id"]: r for r in engine.timelines.rows(time.monotonic())}
    assert len(rows) == 3 and not engine.timelines.live
    for out in outs:
        (line,) = engine.timelines.find(out.request_id, time.monotonic())
        serial = line["serial"]
        chunks = [s["prefill"][serial][0] for s in steps if serial in s["prefill"]]
        decoded = [s["decode"][serial] for s in steps if serial in s["decode"]]
        spans = line["spans"]
        assert [s["tokens"] for s in spans if s["kind"] == "prefill"] == chunks
        assert sum(chunks) == len(out.prompt_token_ids)
        decode = [s for s in spans if s["kind"] == "decode"]
        assert sum(s["steps"] for s in decode) == len(decoded)
        assert sum(s["tokens"] for s in decode) == 11  # the first token comes from the last prefill chunk
        assert max(s["most_rows"] for s in decode) == max(decoded)
        assert sum(s["mean_rows"] * s["steps"] for s in decode) == sum(decoded)
        assert spans[0]["kind"] == "queued" and spans[0]["start_s"] == 0
        starts = [s["start_s"] for s in spans]
        assert starts == sorted(starts) and all(s["end_s"] >= s["start_s"] for s in spans)
        m = out.metrics
        assert line["finish_reason"] == "length" and line["output_tokens"] == 12
        assert abs(line["ttft_s"] - (m.first_token_time - m.arrival_time)) < 1e-6
        assert line["prompt"] is not None and line["answer"] == out.outputs[0].text
    assert len([c for c in steps if rows[outs[0].request_id]["serial"] in c["prefill"]]) == 3  # 64 + 64 + 22
    # the same prompt again: its first chunk says how much the prefix cache held
    again = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    (line,) = engine.timelines.find(again.request_id, time.monotonic())
    first = next(s for s in line["spans"] if s["kind"] == "prefill")
    assert first["cached"] == again.num_cached_tokens > 0 and line["cached_tokens"] == again.num_cached_tokens


def test_preemption_and_the_recompute_after_it_show_in_the_timeline(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    llm = LLM(model=path, max_model_len=256, kv_cache_gib=17 * BLOCK_BYTES / 2**30)
    engine = llm.engine
    steps = _watch(engine)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(40)] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    preempted = {serial for s in steps for serial in s["preempted"]}
    assert preempted, "the pool was meant to be too small for every row at once"
    lines = engine.timelines.rows(time.monotonic())
    assert {line["serial"] for line in lines if line["preemptions"]} == preempted
    for line in lines:
        (full,) = engine.timelines.find(line["request_id"], time.monotonic())
        kinds = [s["kind"] for s in full["spans"]]
        assert kinds.count("preempted") == line["preemptions"]
        for i, kind in enumerate(kinds):
            if kind == "preempted":  # queued again, then computed again from a prefill chunk
                assert kinds[i + 1] == "queued" and kinds[i + 2] == "prefill"


def test_live_sequences_show_their_progress_and_aborted_ones_end_with_their_reason(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.add_request([5, 6, 8], SamplingParams(max_tokens=50, ignore_eos=True, n=2), request_id="b")
    assert [r["status"] for r in engine.timelines.rows(time.monotonic())] == ["waiting"] * 3
    for _ in range(4):
        engine.step()
    live = engine.timelines.rows(time.monotonic())
    assert all(r["status"] == "running" and r["output_tokens"] == 4 for r in live)
    assert len(engine.timelines.find("b", time.monotonic())) == 2  # n = 2: both sequences
    assert engine.timelines.find("b", time.monotonic())[0]["blocks"]
    engine.abort("a")
    while engine.has_unfinished():
        engine.step()
        if not engine.timelines.find("a", time.monotonic())[0]["status"] == "finished":
            continue
        engine.abort("b")
    (a,) = engine.timelines.find("a", time.monotonic())
    assert a["finish_reason"] == "abort" and a["status"] == "finished" and a["blocks"] == []
    assert [r["finish_reason"] for r in engine.timelines.find("b", time.monotonic())] == ["abort", "abort"]


def test_the_recorder_keeps_a_bounded_ring_of_finished_sequences(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02)
    llm.engine.timelines = recorder = TimelineRecorder(keep=5)
    outs = llm.generate([[3, 4, i] for i in range(5, 17)], SamplingParams(max_tokens=2), use_tqdm=False)
    kept = [r["request_id"] for r in recorder.rows(time.monotonic())]
    assert kept == [o.request_id for o in reversed(outs[-5:])]  # the newest first
    assert recorder.find(outs[0].request_id, time.monotonic()) == []


def test_a_structured_request_counts_its_grammar_masking(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, structured_outputs={"regex": "(ab)+"}),
                       use_tqdm=False)[0]
    (line,) = llm.engine.timelines.find(out.request_id, time.monotonic())
    assert line["grammar_mask_s"] > 0 and line["params"]["structured"]
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert llm.engine.timelines.find(plain.request_id, time.monotonic())[0]["grammar_mask_s"] is None


def test_the_server_serves_the_table_and_a_requests_timeline(tiny_checkpoint):
    """What an attached console reads: GET /requests (a line each) and GET /requests/{id} (the spans), and a
    404 naming the route that lists what is kept."""
    import httpx

    from tests.helpers import tiny_server_running

    with tiny_server_running(tiny_checkpoint("llama")) as server:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "ignore_eos": True, "n": 2,
                "request_id": "mine"}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        table = httpx.get(server.url + "/requests", timeout=30).json()["requests"]
        assert [r["request_id"] for r in table] == ["cmpl-mine", "cmpl-mine"]
        assert all(r["status"] == "finished" and r["output_tokens"] == 5 for r in table)
        found = httpx.get(server.url + "/requests/cmpl-mine", timeout=30).json()
        assert len(found["sequences"]) == 2
        assert {s["kind"] for s in found["sequences"][0]["spans"]} >= {"queued", "prefill", "decode"}
        missing = httpx.get(server.url + "/requests/nobody", timeout=30)
        assert missing.status_code == 404 and "GET /requests" in missing.json()["error"]["message"]
        # an attached console reads the same through its RemoteHost (the request screen's source)
        from console.remote import RemoteHost

        remote = RemoteHost(server.url)
        assert [s["name"] for s in remote.timeline("cmpl-mine")] == ["cmpl-mine", "cmpl-mine#1"]
        assert remote.timeline("cmpl-mine")[0]["prompt"] == "hello there" and remote.timeline("nobody") == []
        assert httpx.post(server.url + "/v1/completions", timeout=60,
                          json={**body, "request_id": "other", "n": 1}).status_code == 200
        assert [r["name"] for r in remote.rows("mine#")] == ["cmpl-mine#1"]  # ?match= on the name
        assert [r["name"] for r in remote.rows("MINE")] == ["cmpl-mine#1", "cmpl-mine"]  # any case, newest first
        assert len(remote.rows("length")) == 3 and remote.rows("nothing like it") == []  # the finish reason too
