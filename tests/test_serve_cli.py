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
