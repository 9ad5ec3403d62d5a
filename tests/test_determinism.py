"""Same request, same answer: a row's numbers depend on its own tokens only (batch invariance, --batch-invariant).

Each row's output (its tokens and each token's logprob, which is a function of the row's logits) is compared
bitwise with the same request run alone on an engine with other settings. What varies is everything that must
not matter: the rows beside it, the chunk budget, the prefix cache (cold, warm, and a previous answer's blocks),
preemption and recompute, decode against prefill. The property test draws those at random (hypothesis); the
named tests below are SGLang's three kinds and the pairs a user notices.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import LLM
from tests.determinism_helpers import alone, answer, params, run

VOCAB = 49152


@pytest.fixture(scope="module", params=[("int4", True), ("none", True), ("int4", False)],
                ids=["int4-fused", "dense-fused", "int4-eager"])
def engines(request, tiny_checkpoint):
    """Engines on one tiny checkpoint (4-bit packed and dense float32; on the fused CPU kernels, which run wherever
    a C compiler exists, and on the eager torch ops): a reference that runs each request alone, and crowds with
    small chunk budgets, a small KV pool (preemption), the prefix cache on and off."""
    path = tiny_checkpoint("llama")
    quantization, fused = request.param
    common = dict(model=str(path), quantization=quantization, max_model_len=256, batch_invariant=True,
                  fused_cpu_kernels=fused)
    reference = LLM(**common, kv_cache_gib=0.01, enable_prefix_caching=False)
    crowds = {
        "chunk16": LLM(**common, kv_cache_gib=0.01, max_num_batched_tokens=16, max_num_seqs=8),
        "chunk48-nocache": LLM(**common, kv_cache_gib=0.01, max_num_batched_tokens=48, max_num_seqs=8,
                               enable_prefix_caching=False),
        "preempt": LLM(**common, kv_cache_gib=40 * 8192 / 2**30, max_num_batched_tokens=64, max_num_seqs=8),
    }
    return reference, crowds


rows = st.lists(
    st.tuples(st.integers(0, 3),  # which shared prefix (0: none)
              st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=70),
              st.booleans(), st.integers(0, 2**31), st.integers(1, 6)),
    min_size=1, max_size=7)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batch=rows, crowd=st.sampled_from(["chunk16", "chunk48-nocache", "preempt"]), warm=st.booleans())
def test_a_row_is_the_same_whatever_shares_its_step(engines, batch, crowd, warm):
    reference, crowds = engines
    prefixes = {0: [], 1: list(range(100, 140)), 2: list(range(200, 217)), 3: list(range(100, 131))}
    requests = [(prefixes[p] + tail, params(greedy, seed, n)) for p, tail, greedy, seed, n in batch]
    llm = crowds[crowd]
    if warm:  # the prefix cache holds blocks of these prompts, computed by another step
        run(llm, requests[:1])
    assert run(llm, requests) == alone(reference, requests)


def test_the_preempting_engine_preempts(engines):
    """The 'preempt' crowd above really recomputes rows (else it would test nothing the others do not)."""
    _, crowds = engines
    llm = crowds["preempt"]
    before = llm.engine.scheduler.num_preemptions
    run(llm, [(list(range(300 + 7 * i, 380 + 7 * i)), params(True, 0, 40)) for i in range(6)])
    assert llm.engine.scheduler.num_preemptions > before


# ---- the default model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def invariant_llm():
    """The default model, batch-invariant."""
    return LLM(max_model_len=1024, kv_cache_gib=0.1, batch_invariant=True)


@pytest.fixture(scope="module")
def chunked_llm():
    """The default model with a 32-token step budget: every prompt here is prefilled in chunks."""
    return LLM(max_model_len=1024, kv_cache_gib=0.1, max_num_batched_tokens=32, max_num_seqs=32, batch_invariant=True)


TEXT = ("The harbour was quiet before dawn. Fishing boats rocked against the pier while gulls circled, waiting "
        "for the first catch. An old woman walked along the stones with a basket of bread, greeting the sailors "
        "by name, and the smell of salt and tar hung in the cold air as the lighthouse turned its last slow "
        "circles over the water.")


@pytest.mark.default_model
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(st.tuples(st.integers(1, 120), st.booleans(), st.integers(0, 2**31), st.integers(1, 4)),
                      min_size=2, max_size=5))
def test_a_row_of_the_default_model_is_the_same_whatever_shares_its_step(invariant_llm, chunked_llm, batch):
    """The property test on the default model's 4-bit path: random prefixes of one text (the prefix cache holds
    the earlier ones' blocks), greedy and seeded, batched with 32-token chunks, each against itself alone."""
    ids = invariant_llm.get_tokenizer().encode(TEXT)
    requests = [(ids[:n], params(greedy, seed, tokens)) for n, greedy, seed, tokens in batch]
    assert run(chunked_llm, requests) == alone(invariant_llm, requests)


@pytest.mark.default_model
def test_the_same_prompt_in_batches_of_every_size(invariant_llm):
    """SGLang's first kind: one prompt, alone and among 1, 3, 7 and 15 others (greedy and seeded)."""
    ids = invariant_llm.get_tokenizer().encode(TEXT)
    for greedy in (True, False):
        target = (ids, params(greedy, 7, 24))
        want = run(invariant_llm, [target])[0]
        for size in (2, 4, 8, 16):
            others = [(ids[: 10 + 9 * i], params(i % 2 == 0, i, 24)) for i in range(size - 1)]
            assert run(invariant_llm, [*others, target])[-1] == want, (greedy, size)


@pytest.mark.default_model
def test_short_and_long_prompts_mixed(invariant_llm, chunked_llm):
    """SGLang's second kind: short and long prompts in one batch, each against itself alone, with and without
    chunked prefill."""
    ids = invariant_llm.get_tokenizer().encode(TEXT * 3)
    requests = [(ids[: n], params(n % 3 == 0, n, 12)) for n in (5, 180, 12, 230, 40, 3)]
    want = alone(invariant_llm, requests)
    assert run(invariant_llm, requests) == want
    assert run(chunked_llm, requests) == want


@pytest.mark.default_model
def test_prefixes_of_one_text_batched_at_random(invariant_llm, chunked_llm):
    """SGLang's third kind: prefixes of one long text at different lengths, in shuffled batches; the prefix cache
    holds the earlier ones' blocks when the later ones run."""
    import random

    ids = invariant_llm.get_tokenizer().encode(TEXT * 2)
    lengths = list(range(20, len(ids), 23))
    requests = [(ids[:n], params(True, 0, 8)) for n in lengths]
    want = alone(invariant_llm, requests)
    shuffled = random.Random(0)
    for llm in (invariant_llm, chunked_llm):
        order = list(range(len(requests)))
        shuffled.shuffle(order)
        got = run(llm, [requests[i] for i in order])
        assert [got[order.index(i)] for i in range(len(requests))] == want


@pytest.mark.default_model
def test_a_conversation_reads_its_previous_answer_from_the_cache(invariant_llm, chunked_llm):
    """A multi-turn chat: each turn's prompt holds the previous answer, whose blocks were written by decode
    steps and come back from the prefix cache; a cold engine (no cache) prefills them and must agree."""
    cold = LLM(max_model_len=1024, kv_cache_gib=0.1, enable_prefix_caching=False, batch_invariant=True)
    messages = []
    for turn, question in enumerate(["Name a fruit.", "Why that one?", "Give a recipe with it.", "Shorter."]):
        messages.append({"role": "user", "content": question})
        sampling = params(turn % 2 == 0, turn, 40)
        warm = invariant_llm.chat([messages], sampling, use_tqdm=False)[0]
        chunked = chunked_llm.chat([messages], sampling, use_tqdm=False)[0]
        fresh = cold.chat([messages], sampling, use_tqdm=False)[0]
        assert answer(warm) == answer(fresh) == answer(chunked), turn
        messages.append({"role": "assistant", "content": warm.outputs[0].text})
    assert invariant_llm.engine.stats().prefix_cache.hits > 0


def _completion(url: str, body: dict) -> tuple[str, list[float]]:
    """(text, each token's logprob) of one completion, streamed or not: the stream's chunks joined."""
    import json

    import httpx

    if not body.get("stream"):
        choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]
    text, logprobs = "", []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    return text, logprobs


def test_stream_and_non_stream_agree_in_a_crowd(tiny_checkpoint):
    """The same greedy and seeded requests streamed and not, sent at once among others on a 4-bit server: the same
    text and the same logprobs, byte for byte."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import tiny_server_running

    bodies = [{"model": "tiny", "prompt": f"Story {i}: once", "max_tokens": 12, "ignore_eos": True, "logprobs": 1,
               "temperature": 0.8 if i % 2 else 0, "seed": i} for i in range(4)]
    flags = {"quantization": "int4", "max_num_batched_tokens": 16, "max_num_seqs": 8}
    with tiny_server_running(tiny_checkpoint("llama"), flags) as server:
        url = server.url + "/v1/completions"
        jobs = [{**b, "stream": stream} for b in bodies for stream in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda body: _completion(url, body), jobs))
        assert server.host.stats().scheduler.peak_running >= 2
    for i in range(len(bodies)):
        plain, streamed = answers[2 * i], answers[2 * i + 1]
        assert len(plain[1]) == 12 and plain == streamed, i


TWO_PROCESS_RUN = """
import json, sys
from nanoserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], quantization="int4", max_model_len=256, kv_cache_gib=0.01, max_num_seqs=int(sys.argv[2]))
prompts = [[5 + 7 * i + j for j in range(3 + 11 * i)] for i in range(6)]
params = [SamplingParams(max_tokens=10, temperature=0.9 if i % 2 else 0, seed=i, logprobs=1, ignore_eos=True)
          for i in range(6)]
outs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps([[list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                  o.outputs[0].token_ids)]] for o in outs]))
print(llm.engine.numerics.determinism, file=sys.stderr)
"""


def test_two_processes_give_the_same_bytes(tiny_checkpoint, tmp_path):
    """Two fresh processes on a 4-bit checkpoint, one running the requests one at a time and one all together:
    the first times the head's form and writes it to the kernel table, the second reads it, and both answer
    alike (no choice depends on timing at load)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", TWO_PROCESS_RUN, str(tiny_checkpoint("llama")), rows],
                           capture_output=True, text=True, env=env, timeout=300) for rows in ("1", "8")]
    for process in runs:
        assert process.returncode == 0, process.stderr[-2000:]
        assert process.stderr.strip().endswith("batch-invariant") and "not batch-invariant" not in process.stderr
    assert (tmp_path / "kernels.json").is_file()
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)
