"""The API key from the command line, a file, or the environment (NANOSERVE_API_KEY, then vLLM's VLLM_API_KEY),
in that order; a key file that is missing or empty stops the start; the log says where the key came from and
never the key; the console's --attach reads the key the same ways."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from nanoserve.api_key import resolve_api_key
from nanoserve.errors import ConfigError
from tests.helpers import tiny_server_running, wait_until

ENV = {"NANOSERVE_API_KEY": "from-nanoserve-env", "VLLM_API_KEY": "from-vllm-env"}


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("from-file\n")
    return str(path)


def test_the_key_comes_by_precedence(key_file):
    assert resolve_api_key("from-flag", key_file, ENV) == ("from-flag", "--api-key")
    assert resolve_api_key(None, key_file, ENV) == ("from-file", f"--api-key-file {key_file}")  # newline dropped
    assert resolve_api_key(None, None, ENV) == ("from-nanoserve-env", "the NANOSERVE_API_KEY environment variable")
    assert resolve_api_key(None, None, {"VLLM_API_KEY": "v"}) == ("v", "the VLLM_API_KEY environment variable")
    assert resolve_api_key(None, None, {"NANOSERVE_API_KEY": ""}) == (None, None)  # set but empty: no key


def test_a_missing_or_empty_key_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        resolve_api_key(None, str(tmp_path / "absent"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty; write the key into it"):
        resolve_api_key(None, str(tmp_path / "empty"), ENV)  # never falls back to the environment


def test_serve_refuses_to_start_on_a_missing_key_file(tmp_path):
    """Before the model loads (the model path does not exist either, and that error would come first)."""
    proc = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", str(tmp_path / "no-such-model"),
                           "--port", "0", "--api-key-file", str(tmp_path / "absent")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--api-key-file" in proc.stderr and "no such file" in proc.stderr, proc.stderr


def test_serve_takes_the_key_from_vllms_variable_and_says_so(tiny_checkpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", str(tiny_checkpoint("llama")), "--max-model-len", "128",
           "--kv-cache-gib", "0.01", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "VLLM_API_KEY": "vllm-secret", "PYTHONUNBUFFERED": "1"})
    try:
        lines, deadline = [], time.monotonic() + 120
        while not any("serving" in line for line in lines) and time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
        said = "".join(lines)
        assert "API key from the VLLM_API_KEY environment variable" in said and "vllm-secret" not in said, said
        url = f"http://127.0.0.1:{port}/v1/models"
        assert wait_until(lambda: httpx.get(url).status_code == 401, timeout=30)
        assert httpx.get(url, headers={"Authorization": "Bearer vllm-secret"}).status_code == 200
    finally:
        proc.kill()
        proc.wait(30)


def test_the_console_attaches_with_the_key_from_the_environment(tiny_checkpoint, monkeypatch, capsys):
    from console.cli import main

    with tiny_server_running(tiny_checkpoint("llama"), api_key="sesame") as server:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        monkeypatch.setenv("NANOSERVE_API_KEY", "sesame")
        assert main(["--once", "--refresh", "0.1", "--attach", server.url]) == 0
        assert "serving tiny" in capsys.readouterr().out
        monkeypatch.delenv("NANOSERVE_API_KEY")
        monkeypatch.setenv("VLLM_API_KEY", "sesame")
        assert main(["--once", "--refresh", "0.1", "--attach", server.url]) == 0
