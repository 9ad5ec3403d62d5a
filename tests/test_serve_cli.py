"""`nanoserve serve MODEL` as a user runs it: it says where it listens, answers, and Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest


def test_serve_prints_its_address_and_stops_on_ctrl_c(tiny_checkpoint):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = tiny_checkpoint("llama")
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", str(model),  # first, as `vllm serve` takes it
           "--max-model-len", "128", "--kv-cache-gib", "0.01", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        for _ in range(100):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert r.json()["status"] == "ok"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [model.name]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    """The socket is bound first: the refusal names the port and --port, and no model is loaded (the model path
    given here does not exist, and that error would come first if the load ran first)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", str(tmp_path / "no-such-model"),
                               "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr and "--port" in proc.stderr
    assert "serving" not in proc.stdout


def test_port_zero_serves_on_the_free_port_it_bound(tiny_checkpoint):
    from nanoserve import EngineConfig
    from nanoserve.server.serve import Server

    server = Server(EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, kv_cache_gib=0.01),
                    port=0).start()
    try:
        assert server.address[1] != 0 and httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


LAUNCHER = """
import sys, time
from nanoserve import cli
from nanoserve.engine import Engine

real_step = Engine.step

def slow_step(self):  # every step takes 20 ms, so a long answer is still streaming when the signal comes
    time.sleep(0.02)
    return real_step(self)

Engine.step = slow_step
sys.exit(cli.main(sys.argv[1:]))
"""


def _serve_slowly(tmp_path, model, *flags):
    launcher = tmp_path / "slow_serve.py"
    launcher.write_text(LAUNCHER)
    cmd = [sys.executable, str(launcher), "serve", str(model), "--max-model-len", "512", "--kv-cache-gib", "0.01",
           "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline, line = time.monotonic() + 120, ""
    while "serving" not in line and time.monotonic() < deadline:
        line = proc.stdout.readline()
    return proc, line.split(" at ")[1].split("/v1")[0]


@pytest.mark.parametrize("sig,timeout,tokens,finish", [
    (signal.SIGINT, "30", 60, "length"),  # time enough: the stream finishes as it would have
    (signal.SIGTERM, "0.5", 400, "abort"),  # not enough: it is aborted, and still ends properly
])
def test_a_stop_signal_ends_every_stream_properly_and_exits_zero(tiny_checkpoint, tmp_path, sig, timeout, tokens,
                                                                 finish):
    proc, url = _serve_slowly(tmp_path, tiny_checkpoint("llama"), "--shutdown-timeout", timeout)
    try:
        body = {"prompt": "a long story", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    proc.send_signal(sig)
                    started = time.monotonic()
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == finish
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < float(timeout) + 10
        output = proc.stdout.read()
        assert "Traceback" not in output and "Event loop is closed" not in output, output
        assert "stopping" in output and "nanoserve: stopped" in output
    finally:
        if proc.poll() is None:
            proc.kill()
