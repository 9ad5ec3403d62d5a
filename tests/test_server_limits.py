"""What hostile or careless clients can hold: bodies counted as they arrive, a burst that cannot overfill the
queue, prompts prepared off the event loop, headers that must arrive in time, slow readers in bounded memory."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from nanoserve import LLM, EngineConfig, SamplingParams
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.collector import OutputCollector
from nanoserve.server.host import EngineHost, HostStopped, QueueFull
from nanoserve.server.serve import Server

from .helpers import wait_until

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01), port=0,
               served_model_name="tiny", header_timeout=0.5).start()
    yield s
    s.stop()


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def test_a_chunked_body_is_counted_as_it_arrives(server):
    """No Content-Length to trust: the bytes are counted, and reading stops one past the limit."""
    sent = 0

    def chunks():
        nonlocal sent
        yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        for _ in range(9 * 16):  # 9 MiB of prompt, in 64 KiB pieces
            sent += 2**16
            yield b"word " * (2**16 // 5)
        yield b'"}'

    before = health(server)["scheduler"]["prompt_tokens_total"]
    try:
        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
    except httpx.HTTPError:  # the server may close before the client has sent its last chunk; ask again
        pytest.fail("the server closed the connection without a 413")
    assert r.status_code == 413 and "counted as sent" in r.json()["error"]["message"]
    assert health(server)["scheduler"]["prompt_tokens_total"] == before


def test_tokenizing_a_huge_prompt_does_not_stall_other_requests(server):
    """The tokenizer is held mid-prompt; meanwhile /health and other requests answer (on the loop they waited)."""
    tokenizer = server.host.engine.tokenizer
    real, entered, release = tokenizer.encode, threading.Event(), threading.Event()

    def held_encode(text, *args, **kwargs):
        if text.startswith("HOLD"):
            entered.set()
            release.wait(20)
        return real(text, *args, **kwargs)

    tokenizer.encode = held_encode
    try:
        result = {}
        held = threading.Thread(target=lambda: result.update(r=httpx.post(
            server.url + "/v1/completions", json={"prompt": "HOLD me", "max_tokens": 2, **GREEDY}, timeout=30)))
        held.start()
        assert entered.wait(10)
        assert httpx.get(server.url + "/health", timeout=2).status_code == 200
        other = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, **GREEDY},
                           timeout=5)
        assert other.status_code == 200
        release.set()
        held.join(30)
        assert result["r"].status_code == 200
    finally:
        release.set()
        tokenizer.encode = real


def test_headers_that_never_finish_lose_their_connection(server):
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        started = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 4
    with socket.create_connection(server.address, timeout=5) as sock:  # a prompt client is unaffected
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.8)  # past the header timeout, while its response is already on the wire
        assert b"200 OK" in sock.recv(4096)


def test_a_burst_cannot_overfill_the_waiting_queue(tiny_checkpoint):
    """Ten requests arrive within one step: exactly max_waiting are admitted to wait, the rest are refused."""
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01, max_num_seqs=1).engine
    host = EngineHost(engine, max_waiting=3).start()
    gate = threading.Event()
    real_step = engine.step

    def gated_step():
        gate.wait(10)
        return real_step()

    try:
        host.submit("occupies the row", SamplingParams(max_tokens=50, **GREEDY), lambda _: None)
        engine.step = gated_step  # the engine is inside a step while the burst arrives
        outcomes = []  # each a refusal (at the send, or from the engine thread) or an admission
        for _ in range(10):
            try:
                outcomes.append(host.send("burst", SamplingParams(max_tokens=2, **GREEDY), lambda _: None, None))
            except QueueFull as e:
                outcomes.append(e)
        gate.set()
        answers = [o if isinstance(o, QueueFull) else o.exception(10) for o in outcomes]
        assert sum(a is None for a in answers) == 3
        assert all(isinstance(a, QueueFull) and "retry shortly" in str(a) for a in answers if a is not None)
    finally:
        gate.set()
        host.shutdown()


def test_routes_say_503_while_no_engine_is_loaded(server):
    host = server.host
    engine = host.engine
    host.engine = None  # as during a restart, between the old engine's release and the new one's load
    try:
        for method, route, body in [("get", "/v1/models", None), ("post", "/tokenize", {"prompt": "hi"}),
                                    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 1})]:
            r = httpx.request(method, server.url + route, json=body)
            assert r.status_code == 503, (route, r.text)
            assert r.json()["error"]["type"] == "server_error"
    finally:
        host.engine = engine


def test_a_restart_whose_flags_and_fallback_both_fail_says_so(tiny_checkpoint, monkeypatch):
    import nanoserve.server.host as host_module

    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    host = EngineHost(engine).start()

    def no_load(config, progress=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(host_module, "Engine", no_load)
    with pytest.raises(RuntimeError, match="out of memory"):
        host.restart(engine.config)
    state = host.health()
    assert state.status == "failed" and "previous flags failed too" in state.reason
    with pytest.raises(HostStopped, match="previous flags failed too"):
        host.submit("hi", SamplingParams(max_tokens=1), lambda _: None)
    with pytest.raises(HostStopped, match="previous flags failed too"):
        host.serving()


def test_a_send_racing_shutdown_is_always_answered(tiny_checkpoint):
    """Sends racing a shutdown are each answered (admitted, or refused with HostStopped), never left pending; the
    sender's own failures are collected, so a broken call fails the test instead of ending its thread quietly."""
    engine = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01).engine
    sent = 0
    for _ in range(20):
        host = EngineHost(engine).start()
        futures, errors, stop = [], [], threading.Event()

        def sender(host=host, futures=futures, errors=errors, stop=stop):
            while not stop.is_set():
                try:
                    futures.append(host.send("hi", SamplingParams(max_tokens=1), lambda _: None, None))
                except HostStopped:
                    return
                except Exception as exc:  # anything else is the failure this test looks for
                    errors.append(exc)
                    return

        t = threading.Thread(target=sender)
        t.start()
        time.sleep(0.005)
        host.shutdown()
        stop.set()
        t.join()
        assert not errors, errors
        for f in futures:
            f.exception(5)  # answered (a result or HostStopped), never left pending: this raises TimeoutError
        sent += len(futures)
    assert sent > 0  # the race was run: sends landed before the shutdowns


def _out(index: int, text: str, ids: tuple, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, (1,), [CompletionOutput(index, text, ids, "length" if finished else None)],
                         finished, text, ids)


async def test_a_slow_reader_holds_one_merged_output_per_completion():
    collector = OutputCollector()
    for i in range(100):
        collector.put(_out(0, f"{i} ", (i,)))
        collector.put(_out(1, "x", (i,)))
    collector.put(_out(0, "end", (100,), finished=True))
    assert len(collector) == 2 and collector.merged == 199
    first, last = await collector.get(), await collector.get()
    assert first.outputs[0].index == 1 and first.delta_text == "x" * 100
    assert last.finished and last.delta_token_ids == tuple(range(101))
    assert last.delta_text == "".join(f"{i} " for i in range(100)) + "end"


async def test_an_error_ends_the_collector_after_what_came_before():
    collector = OutputCollector()
    collector.put(_out(0, "a", (1,)))
    collector.put(RuntimeError("failed"))
    assert (await collector.get()).delta_text == "a"
    with pytest.raises(RuntimeError, match="failed"):
        await asyncio.wait_for(collector.get(), 1)


def test_a_slow_streaming_client_gets_every_token(server):
    """The server keeps producing while the client does not read; what it finally reads is the whole answer."""
    body = {"prompt": "a long story", "max_tokens": 100, "stream": True, **GREEDY}
    whole = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}).json()
    text, lines = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        stream = r.iter_lines()
        lines.append(next(stream))
        assert wait_until(lambda: health(server)["scheduler"]["running"] == 0)  # done while we were not reading
        lines.extend(stream)
    for line in lines:
        if line.startswith("data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
    assert text == whole["choices"][0]["text"] and [x for x in lines if x][-1] == "data: [DONE]"
