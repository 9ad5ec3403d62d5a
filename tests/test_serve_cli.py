"""`nanoserve serve MODEL` as a user runs it: it says where it listens, answers, and Ctrl-C stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


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
