"""A failure that belongs to one request ends that request alone.

A grammar can compile and still fail while generating: llguidance holds at most 2,000 items in a parser row, so a
Lark rule of 5,000 alternatives (65,000 characters, inside the 100,000-character grammar limit) compiles and
then fails on its first token. (A JSON schema's `anyOf` that would fail so, 5,000 objects, is past the schema
size limit and refused before it is compiled.) That failure is the request's own: it ends with finish reason "error" and a message naming the limit
(a 400 for a caller waiting on the whole answer, an error event in a stream), while every other request in the
same steps goes on with the bytes it would have had alone, and /health stays "ok" (it says "unhealthy" for
engine faults only, never with another caller's text)."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.server.serve import Server

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The river ran", "Seven small boats", "In the morning the"]


def wide_lark(n: int = 5_000) -> str:
    """A rule of `n` distinct 8-letter words: it compiles, then fails on the first token it takes."""
    rng = random.Random(0)
    words = {"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(n)}
    return "start: " + " | ".join(f'"{w}"' for w in sorted(words))


def wide_any_of(n: int = 5_000) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                      for i in range(n)]}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def alone(ckpt):
    llm = LLM(model=ckpt, max_model_len=128, kv_cache_gib=0.01)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_a_schema_that_would_fail_while_generating_is_refused_before_it_compiles():
    with pytest.raises(ValueError, match="the limit is 100,000"):
        SamplingParams(temperature=0, max_tokens=12, structured_outputs={"json": wide_any_of()})


def test_a_grammar_that_fails_while_generating_ends_its_request_alone(ckpt, alone):
    llm = LLM(model=ckpt, max_model_len=128, kv_cache_gib=0.01)
    failing = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"grammar": wide_lark()})
    outs = llm.generate([*PROMPTS, "Say it"], [GREEDY] * len(PROMPTS) + [failing], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs[:3]] == [list(t) for t in alone]
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs[:3])
    bad = outs[3]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "max is 2000" in bad.error and "simplify the grammar" in bad.error, bad.error
    assert len(bad.error) < 600  # llguidance's parser dump is not passed on
    stats = llm.engine.stats()
    assert stats.kv.blocks_free == stats.kv.blocks_total
    assert llm.engine.output_processor.finished["error"] == 1
    llm.engine.audit()


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(EngineConfig(model=ckpt, max_model_len=256, kv_cache_gib=0.02), port=0,
               served_model_name="tiny").start()
    yield s
    s.stop()


def stream_text(url: str, prompt: str, n: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out[prompt] = events


def test_other_callers_streams_and_health_outlive_a_failing_grammar(server):
    url = server.url
    expected = {}
    for p in PROMPTS:  # each alone, not streamed: the text the streams must carry
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 60,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120)
        expected[p] = r.json()["choices"][0]["text"]
    got: dict = {}
    threads = [threading.Thread(target=stream_text, args=(url, p, 60, got)) for p in PROMPTS]
    for t in threads:
        t.start()
    grammar = wide_lark()
    for _ in range(3):  # three in a row: enough to make /health unhealthy were these counted as engine faults
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Say it", "max_tokens": 8,
                                                        "guided_grammar": grammar}, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "max is 2000" in error["message"], error
    stream = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Say it", "max_tokens": 8,
                                                        "stream": True, "guided_grammar": grammar}, timeout=120)
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "max is 2000" in json.loads(events[-2])["error"]["message"], events
    for t in threads:
        t.join(timeout=180)
    for p in PROMPTS:
        assert got[p][-1] == "[DONE]", got[p][-3:]
        chunks = [json.loads(e) for e in got[p][:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected[p]
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert "max is 2000" not in health.text and "grammar" not in health.text  # no caller's error in the probe
    kv = health.json()["kv"]
    assert kv["blocks_free"] == kv["blocks_total"]
