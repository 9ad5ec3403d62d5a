"""Tensor parallelism on the CPU (gloo between processes): the group's answers against one rank's.

The oracle is the same engine at tensor_parallel_size 1 on the same weights. Dense float32 answers agree to
float32 rounding (the row-parallel partial sums are added in another order); greedy and seeded generations are
the same tokens. The default model's 4-bit path is compared by vLLM's logprobs-close rule.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError
from nanoserve.parallel.group import free_loopback_address
from tests.oracles import logprobs_close

KINDS = ("llama", "qwen2", "qwen3", "phi3")  # phi3: its fused qkv_proj and gate_up_proj split per rank
SMALL = dict(max_model_len=256, kv_cache_gib=0.02)
PROMPTS = [[1, 400 + 37 * i, 900 + 11 * i, 2000 + i, 77, 5 + i, 3000 + 13 * i][: 3 + i % 5] for i in range(10)]


def close_llm(llm: LLM) -> None:
    llm.engine.close()


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_checkpoint):
    """(kind, one rank, two ranks) on the same tiny random checkpoint."""
    path = str(tiny_checkpoint(request.param))
    one, two = LLM(model=path, **SMALL), LLM(model=path, tensor_parallel_size=2, **SMALL)
    yield request.param, one, two
    close_llm(two)


def logprob_rows(out) -> list[dict[int, float]]:
    rows = [d for d in out.prompt_logprobs or () if d] + list(out.outputs[0].logprobs)
    return [{token: entry.logprob for token, entry in row.items()} for row in rows]


def test_logits_at_prefill_and_every_decode_step_equal_one_rank(pair):
    kind, one, two = pair
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    for prompt in PROMPTS[:4]:
        a, b = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for llm in (one, two))
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, kind
        for row_a, row_b in zip(logprob_rows(a), logprob_rows(b), strict=True):
            assert row_a.keys() == row_b.keys()
            assert max(abs(row_a[t] - row_b[t]) for t in row_a) < 2e-4, (kind, row_a, row_b)


def test_two_ranks_are_batch_invariant(pair):
    """Each rank's kernels are row-invariant and two partial sums add alike in either order: a row's logprobs in
    a crowd and chunked are the same bytes as alone, and the snapshot says so."""
    kind, _, two = pair
    assert two.engine.numerics.determinism == "batch-invariant"
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    crowd = two.generate(prompts, params, use_tqdm=False)
    for prompt, in_crowd in list(zip(prompts, crowd))[::3]:
        alone = two.generate(prompt, params, use_tqdm=False)[0]
        assert in_crowd.outputs[0].token_ids == alone.outputs[0].token_ids, kind
        assert logprob_rows(in_crowd) == logprob_rows(alone), kind


def test_a_crowd_with_preemption_generates_the_same_tokens(tiny_checkpoint):
    """A pool of 12 blocks for a crowd that needs 36: requests are preempted and recomputed on both sides alike.
    The KV budget is per rank, and a rank holds half the kv heads: half the budget is the same 12 blocks."""
    path = str(tiny_checkpoint("llama"))
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads of 16, float32
    tight = dict(max_model_len=128, max_num_seqs=8)
    one = LLM(model=path, kv_cache_gib=12.5 * block / 2**30, **tight)
    two = LLM(model=path, tensor_parallel_size=2, kv_cache_gib=12.5 * block / 2 / 2**30, **tight)
    assert one.engine.runner.num_blocks == two.engine.runner.num_blocks == 12
    try:
        params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) if i % 2 else
                  SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(12)]
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:6] * 2]
        a = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert a == b
        for llm in (one, two):
            assert llm.engine.stats().scheduler.preemptions > 0, "the pool was meant to be too small"
            llm.engine.audit()  # the block pool is rank 0's: every rank writes the blocks it names
    finally:
        close_llm(two)


def test_four_ranks(tiny_checkpoint):
    path = str(tiny_checkpoint("llama", num_key_value_heads=4))
    one, four = LLM(model=path, **SMALL), LLM(model=path, tensor_parallel_size=4, **SMALL)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
        a, b = (llm.generate({"prompt_token_ids": PROMPTS[3]}, params, use_tqdm=False)[0] for llm in (one, four))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(logprob_rows(a), logprob_rows(b), strict=True):
            assert max(abs(row_a[t] - row_b[t]) for t in row_a) < 2e-4
        parallel = four.engine.stats().features["parallel"]
        assert parallel["world_size"] == 4 and len(parallel["ranks"]) == 4
        assert four.engine.numerics.determinism.startswith("not batch-invariant here: 4 ranks sum")  # said, not hidden
    finally:
        close_llm(four)


def test_the_snapshot_says_what_the_group_holds_and_spends(pair):
    kind, one, two = pair
    two.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    section = two.engine.stats().features["parallel"]
    assert section["world_size"] == 2 and section["backend"] == "gloo" and section["failed"] is None
    # both ranks on this machine: every all-reduce and decode gather went through shared memory, counted as it ran
    assert set(section["all_reduces_by_path"]) == {"shared memory"} and section["all_reduces_by_path"]["shared memory"]
    assert section["gathers_by_path"]["shared memory"] > 0
    assert section["collectives"] > 0 and section["collective_ms_per_step"] > 0
    assert set(section["ms_per_step_by_kind"]) == {"all_reduce", "gather", "broadcast"}
    whole = sum(p.nbytes for p in one.engine.runner.model.parameters())
    ranks = section["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:  # each rank holds its half of every split weight (norms are whole on each)
        assert 0.45 * whole < r["weights_bytes"] < 0.6 * whole, (r, whole)
        assert r["kv_bytes"] > 0 and (r["rss_bytes"] is None or r["rss_bytes"] > r["weights_bytes"])


def test_a_gather_wider_than_the_shared_buffer_goes_over_gloo_and_agrees(pair):
    """Prompt logprobs over 100 positions: more rows than the buffer holds (max_num_seqs), so that gather takes
    gloo, as every rank decides from the shape; the answers still equal one rank's."""
    kind, one, two = pair
    prompt = [1 + (37 * i) % 40000 for i in range(100)]
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    before = dict(two.engine.stats().features["parallel"]["gathers_by_path"])
    a, b = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for llm in (one, two))
    for row_a, row_b in zip(logprob_rows(a), logprob_rows(b), strict=True):
        assert row_a.keys() == row_b.keys() and max(abs(row_a[t] - row_b[t]) for t in row_a) < 2e-4
    after = two.engine.stats().features["parallel"]["gathers_by_path"]
    assert after.get("gloo", 0) > before.get("gloo", 0)


def test_structured_outputs_and_n_sequences_are_rank_0s_business(pair):
    """The grammar masks the gathered logits on rank 0, and n sequences are rows like any others."""
    kind, one, two = pair
    choice = SamplingParams(max_tokens=8, temperature=0.9, seed=1, n=3,
                            structured_outputs={"choice": ["alpha", "beta gamma", "delta"]})
    a, b = (llm.generate({"prompt_token_ids": PROMPTS[5]}, choice, use_tqdm=False)[0] for llm in (one, two))
    assert [o.text for o in b.outputs] == [o.text for o in a.outputs]
    assert all(o.text in ("alpha", "beta gamma", "delta") for o in b.outputs)


def test_the_default_model_on_three_ranks_answers_paris():
    dense = LLM(tensor_parallel_size=3, quantization="none", max_model_len=512, kv_cache_gib=0.05)
    try:
        out = dense.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        assert "Paris" in out[0].outputs[0].text
    finally:
        close_llm(dense)


def test_the_default_models_4_bit_path_on_three_ranks_is_logprobs_close(default_llm):
    """The 4-bit kernels answer in bfloat16, so the ranks' partial sums round differently from one rank's
    whole sum: the answers are compared by the logprobs-close rule, as any two numerics of one model are."""
    three = LLM(tensor_parallel_size=3, max_model_len=512, kv_cache_gib=0.05)
    try:
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)
        for prompt in ("The capital of France is", "def fibonacci(n):", "Water boils at"):
            ok, equal = logprobs_close(three.generate(prompt, params, use_tqdm=False)[0].outputs[0],
                                       default_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
            assert ok, (prompt, equal)
    finally:
        close_llm(three)


def test_a_size_that_does_not_divide_is_refused_before_any_process_starts():
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"attention heads 9 and kv heads 3; use a size that works \(1, 3\), or"
                                          r".*: write one with python scripts/random-checkpoint.py --out "
                                          r"/tmp/llama-8h and pass --model /tmp/llama-8h$"):
        LLM(tensor_parallel_size=2)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("world", [2, 4, 5, 8])
def test_the_random_checkpoint_the_refusal_names_divides_by_its_size(world):
    """The command the refusal gives writes a shape that `world` ranks can split."""
    from nanoserve.parallel.shard import random_checkpoint_command

    command = random_checkpoint_command(world).split()
    shape = {"--heads": 8, "--kv-heads": 4, "--intermediate": 1536}
    for flag in shape:
        if flag in command:
            shape[flag] = int(command[command.index(flag) + 1])
    assert all(value % world == 0 for value in shape.values()), (world, shape)


def test_two_processes_meet_by_env_rendezvous(tiny_checkpoint, monkeypatch, tmp_path):
    """Rank 0 here, rank 1 a `nanoserve worker` process: the two machines of a real deployment, on loopback.
    Then a worker whose model path is wrong: rank 0 names rank 1 and the reason."""
    path = str(tiny_checkpoint("llama"))
    host, port = free_loopback_address().removeprefix("tcp://").split(":")
    monkeypatch.setenv("MASTER_ADDR", host)
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("NANOSERVE_DISTRIBUTED_KEY", "the same secret on every rank")
    env = {**os.environ, "MASTER_ADDR": host, "MASTER_PORT": port}
    command = [sys.executable, "-m", "nanoserve.cli", "worker", "--rank", "1", "--tensor-parallel-size", "2",
               "--distributed-init", "env://", "--distributed-timeout", "30"]
    worker = subprocess.Popen(command, env=env)
    try:
        two = LLM(model=path, tensor_parallel_size=2, distributed_init="env://", distributed_timeout=30, **SMALL)
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        got = two.generate({"prompt_token_ids": PROMPTS[2]}, params, use_tqdm=False)[0].outputs[0].token_ids
        want = LLM(model=path, **SMALL).generate({"prompt_token_ids": PROMPTS[2]}, params,
                                                 use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        close_llm(two)
        assert worker.wait(30) == 0  # told to stop, it exits cleanly
    finally:
        worker.kill()

    port = free_loopback_address().rsplit(":", 1)[1]
    monkeypatch.setenv("MASTER_PORT", port)
    bad = subprocess.Popen([*command, "--model", str(tmp_path / "missing")], env={**env, "MASTER_PORT": port})
    try:
        with pytest.raises(ConfigError, match=r"rank 1: CheckpointError: model path .*missing.* does not exist"):
            LLM(model=path, tensor_parallel_size=2, distributed_init="env://", distributed_timeout=30, **SMALL)
        assert bad.wait(30) == 1
    finally:
        bad.kill()


def test_a_killed_rank_ends_the_engine_and_the_server_answers_503(tiny_checkpoint):
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    server = Server(EngineConfig(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, **SMALL),
                    port=0).start()
    try:
        url = server.url
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # generating
            victim = server.host.engine.runner.parallel.processes[0]
            killed = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        ended = time.monotonic() - killed
        assert ended < 10, f"the stream took {ended:.1f} s to end after the rank died"
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "tensor-parallel rank 1 was killed by SIGKILL" in health.json()["reason"]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1" in refused.text
        assert server.host.engine.stats().features["parallel"]["failed"].startswith("tensor-parallel rank 1")
    finally:
        server.stop()


async def test_the_console_shows_the_group(tiny_checkpoint):
    pytest.importorskip("textual")
    from console.app import NanoserveConsole
    from nanoserve import EngineConfig
    from tests.console_helpers import Requests, started, text, wait_until

    config = EngineConfig(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, **SMALL)
    app = NanoserveConsole(config, refresh_s=0.05)
    async with app.run_test(size=(150, 48)) as pilot:
        await started(app, pilot, timeout=90)
        Requests(app.server.url, n=2, max_tokens=8).join(60)
        await wait_until(pilot, lambda: "collectives" in text(app, "#parallel"), 10, "the parallel panel")
        shown = text(app, "#parallel")
        assert "world_size" in shown and "2" in shown and "gloo" in shown and "rank 1" in shown
        assert "tensor parallel" not in text(app, "#features-off")


def test_a_rank_that_raises_is_named_with_its_error(tiny_checkpoint):
    """A worker whose step fails (here: a step on a cache it cannot allocate, sent through the real protocol)
    writes why and exits; rank 0's next step names the rank and the error, and the engine serves no more."""
    import torch

    from nanoserve.engine import StepFailed
    from nanoserve.model.batch import StepBatch
    from nanoserve.parallel import worker

    two = LLM(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, **SMALL)
    try:
        one = torch.zeros(1, dtype=torch.long)
        poison = StepBatch(input_ids=one, positions=one, slots=one, num_decode=1,
                           decode_block_table=one.view(1, 1), decode_context_lens=one + 1, prefills=(),
                           logits_indices=one)
        two.engine.runner.parallel.group.send(worker.Step(poison, cache_blocks=2**40))  # rank 1 cannot build it
        with pytest.raises(StepFailed, match=r"tensor-parallel rank 1 .*MemoryError: the KV pool's"):
            two.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), use_tqdm=False)
        assert "rank 1" in two.engine.failed
        with pytest.raises(StepFailed, match="rank 1"):  # and stays failed: the group cannot be repaired
            two.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        close_llm(two)


def test_the_decode_fast_path_works_per_rank(tiny_checkpoint):
    """Buckets, persistent inputs and compaction on rank 0: the other ranks get each planned step's rows."""
    path = str(tiny_checkpoint("llama"))
    fast = dict(decode_buckets=True, persistent_inputs=True, row_compaction=True, **SMALL)
    one, two = LLM(model=path, **SMALL), LLM(model=path, tensor_parallel_size=2, **fast)
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:6]]
        a = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert a == b
        sections = two.engine.stats().features  # the planned path ran, from persistent buffers
        assert sections["inputs"]["steps"] > 0 and sections["buckets"]["shapes_used"] > 0
    finally:
        close_llm(two)


def test_a_restart_into_and_out_of_a_group_leaves_no_rank_behind(tiny_checkpoint):
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    config = EngineConfig(model=str(tiny_checkpoint("llama")), **SMALL)
    server = Server(config, port=0).start()
    try:
        server.host.restart(EngineConfig(model=config.model, tensor_parallel_size=2, **SMALL))
        ranks = server.host.engine.runner.parallel.processes
        body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        grouped = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        server.host.restart(config)
        assert all(not p.is_alive() for p in ranks), "the group's ranks outlived its engine"
        alone = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert grouped["choices"][0]["text"] == alone["choices"][0]["text"]
    finally:
        server.stop()


def test_the_openai_client_gets_one_ranks_answers_from_a_group(tiny_checkpoint):
    """The official client against a 2-rank server: seeded n=2 completions and a streamed chat are the tokens
    the one-rank engine gives offline."""
    from openai import OpenAI

    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    path = str(tiny_checkpoint("llama"))
    server = Server(EngineConfig(model=path, tensor_parallel_size=2, **SMALL), port=0,
                    served_model_name="tiny").start()
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        offline = LLM(model=path, **SMALL)
        got = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=12, n=2, seed=5,
                                        temperature=0.8, extra_body={"ignore_eos": True})
        want = offline.generate({"prompt_token_ids": PROMPTS[4]},
                                SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0]
        assert [c.text for c in got.choices] == [o.text for o in want.outputs]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=10, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        alone = offline.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=10, temperature=0),
                             use_tqdm=False)[0].outputs[0].text
        assert text == alone
    finally:
        server.stop()


def test_a_rank_that_hangs_ends_in_an_error_at_the_timeout(tiny_checkpoint):
    """A stopped rank (SIGSTOP: alive, answering nothing) is not waited for forever: the step fails when the
    group's timeout passes, and says so."""
    from nanoserve.engine import StepFailed

    two = LLM(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, distributed_timeout=3, **SMALL)
    victim = two.engine.runner.parallel.processes[0]
    try:
        two.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(victim.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StepFailed, match=r"waited 3 s \(--distributed-timeout\) for a rank that is alive but"):
            two.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert 3 <= time.monotonic() - started < 15
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        close_llm(two)


def test_speculative_decoding_on_two_ranks_gives_one_ranks_bytes(tiny_checkpoint):
    """Drafts verified across a two-rank group: the same tokens as one rank decoding one at a time."""
    path = str(tiny_checkpoint("llama"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    one = LLM(model=path, **SMALL)
    two = LLM(model=path, tensor_parallel_size=2, speculative_config=spec, **SMALL)
    try:
        prompts = [[3 + (i + j) % 5 for j in range(20 + 3 * i)] for i in range(3)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == want
        assert two.engine.stats().features["speculative"]["num_accepted_tokens"] > 0
    finally:
        close_llm(two)
