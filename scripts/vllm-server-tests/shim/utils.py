# Harness shim for vLLM 0.33.0's tests/utils.py.
#
# vLLM's tests/utils.py imports most of vLLM's engine (torch.distributed, model loader, platforms, kernels ...).
# The server tests only need RemoteOpenAIServer (+ a few constants), so this file re-implements that class
# against `nanoserve serve` and nothing else. The original is kept as ../orig_utils.py.txt for reference.
#
# Flag translation (vLLM `vllm serve` flag -> nanoserve): see FLAG_TABLE below and README/report.
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from typing import Any

import anthropic
import openai
import requests

NANOSERVE_BIN = os.environ.get("NANOSERVE_BIN", "/work/main/.venv/bin/nanoserve")
# PYTHONPATH for the server (a snapshot of nanoserve's committed tree, see run.sh); empty: the editable install.
NANOSERVE_SRC = os.environ.get("NANOSERVE_SRC", "")
SERVER_LOG_DIR = os.environ.get("HARNESS_SERVER_LOG_DIR", "/work/vllm-harness/results/server-logs")

ROCM_EXTRA_ARGS: list[str] = []
MODEL_CONTEXT = 8192  # SmolLM2-135M's positions
DEFAULT_MAX_MODEL_LEN = os.environ.get("HARNESS_DEFAULT_MAX_MODEL_LEN", "2048")

# --- flag table -------------------------------------------------------------------------------------------------
# kind: "pass"    -> passed to nanoserve unchanged (same meaning)
#       "drop"    -> dropped: engine/GPU tuning that no test in scope observes
#       "feature" -> dropped, but the test depends on it: failures in a test whose server dropped one of these are
#                    classified "needs vLLM feature X" (recorded on the server object and in junit properties)
# nargs: how many values follow the flag (None: a boolean flag; for "--x=v" forms the value is inline)
FLAG_TABLE: dict[str, tuple[str, int, str]] = {
    # passed through
    "--port": ("pass", 1, ""),
    "--host": ("pass", 1, ""),
    "--seed": ("pass", 1, ""),
    "--max-model-len": ("pass", 1, ""),
    "--max-num-seqs": ("pass", 1, ""),
    "--max-num-batched-tokens": ("pass", 1, ""),
    "--max-logprobs": ("pass", 1, ""),
    "--served-model-name": ("pass", 1, ""),
    "--api-key": ("pass", 1, ""),
    "--enable-force-include-usage": ("pass", 0, ""),
    "--return-tokens-as-token-ids": ("pass", 0, ""),
    "--enable-prompt-tokens-details": ("pass", 0, ""),
    "--no-enable-prefix-caching": ("pass", 0, ""),
    "--enable-prefix-caching": ("pass", 0, ""),
    # dropped: no observable effect in these tests
    "--enforce-eager": ("drop", 0, "CUDA-graph switch; nanoserve on CPU has no graphs"),
    "--dtype": ("drop", 1, "weights dtype; nanoserve picks float32 on CPU (bf16/half would only slow the CPU run)"),
    "--gpu-memory-utilization": ("drop", 1, "GPU KV sizing; CPU run"),
    "--enable-chunked-prefill": ("drop", 0, "nanoserve always chunks prefill"),
    "--trust-remote-code": ("drop", 0, "no remote code; the embedded model is used"),
    "--load-format": ("drop", 1, "weights format; the embedded model is used"),
    "--enable-auto-tool-choice": ("drop", 0, "nanoserve always allows tool_choice auto"),
    "--runner": ("drop", 1, "generate is nanoserve's only runner"),
    "--disable-log-stats": ("drop", 0, "logging only"),
    "--disable-log-requests": ("drop", 0, "logging only"),
    "--uvicorn-log-level": ("drop", 1, "logging only"),
    "--enable-metrics": ("drop", 0, "nanoserve always serves /metrics"),
    "--shutdown-timeout": ("pass", 1, ""),
    "--max-cpu-loras": ("feature", 1, "LoRA"),
    "--max-lora-rank": ("feature", 1, "LoRA"),
    "--enable-lora": ("feature", 0, "LoRA"),
    "--lora-modules": ("feature", -1, "LoRA"),
    "--limit-mm-per-prompt": ("feature", 1, "multimodal"),
    "--chat-template-content-format": ("drop", 1, "nanoserve detects the template's content format"),
    # dropped, test depends on it
    "--reasoning-parser": ("feature", 1, "reasoning parser"),
    "--chat-template": ("feature", 1, "server-side custom --chat-template"),
    "--root-path": ("feature", 1, "--root-path"),
    "--skip-tokenizer-init": ("feature", 0, "--skip-tokenizer-init"),
    "--enable-prompt-embeds": ("feature", 0, "prompt embeds"),
    "--enable-tokenizer-info-endpoint": ("feature", 0, "/tokenizer_info endpoint"),
    "--enable-server-load-tracking": ("feature", 0, "server load tracking (/load)"),
    "--enable-per-request-metrics": ("pass", 0, ""),
    "--watermark-config": ("feature", 1, "watermarking"),
    "--hf-overrides": ("feature", 1, "--hf-overrides"),
    "--structured-outputs-config.backend": ("drop", 1, "nanoserve has one structured-output backend"),
    "--tokenizer-mode": ("drop", 1, "tokenizer comes with the embedded model"),
    "--generation-config": ("feature", 1, "--generation-config"),
    "--override-generation-config": ("feature", 1, "--override-generation-config"),
}

# every (flag, kind, why) dropped in this pytest process, for the report
DROPPED_LOG: list[tuple[str, str, str]] = []


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def translate_args(model: str, args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """vLLM serve args -> (nanoserve args, dropped behavioural features, dropped flags as text)."""
    out: list[str] = []
    features: list[str] = []
    dropped: list[str] = []
    served_names: list[str] = []
    i = 0
    while i < len(args):
        a = str(args[i])
        inline = None
        if a.startswith("--") and "=" in a:
            a, inline = a.split("=", 1)
        if a == "--model":
            model = inline if inline is not None else args[i + 1]
            i += 1 if inline is not None else 2
            continue
        if a == "--tool-call-parser":
            v = inline if inline is not None else args[i + 1]
            i += 1 if inline is not None else 2
            if v == "hermes":
                out += ["--tool-call-parser", "hermes"]
            else:
                features.append(f"tool-call-parser {v}")
                dropped.append(f"--tool-call-parser {v}")
            continue
        if a == "--served-model-name":
            j = i + 1
            vals = [inline] if inline is not None else []
            if inline is None:
                while j < len(args) and not str(args[j]).startswith("--"):
                    vals.append(str(args[j]))
                    j += 1
            served_names += vals
            i = j
            continue
        spec = FLAG_TABLE.get(a)
        if spec is None:
            # unknown flag: drop it and everything up to the next flag (treated as a behavioural feature)
            j = i + 1
            vals = []
            if inline is None:
                while j < len(args) and not str(args[j]).startswith("--"):
                    vals.append(str(args[j]))
                    j += 1
            features.append(f"unknown vLLM flag {a}")
            dropped.append(" ".join([a, *vals]) if inline is None else f"{a}={inline}")
            i = j
            continue
        kind, nargs, why = spec
        if inline is not None:
            vals = [inline]
            j = i + 1
        elif nargs == -1:
            j = i + 1
            vals = []
            while j < len(args) and not str(args[j]).startswith("--"):
                vals.append(str(args[j]))
                j += 1
        else:
            vals = [str(v) for v in args[i + 1:i + 1 + nargs]]
            j = i + 1 + nargs
        if kind == "pass" and a == "--max-model-len" and int(vals[0]) > MODEL_CONTEXT:
            # the embedded model has 8192 positions; nanoserve refuses a longer --max-model-len
            out += [a, str(MODEL_CONTEXT)]
            dropped.append(f"--max-model-len {vals[0]} (clamped to {MODEL_CONTEXT})")
        elif kind == "pass":
            out += [a, *vals]
        else:
            dropped.append(" ".join([a, *vals]))
            DROPPED_LOG.append((a, kind, why))
            if kind == "feature":
                features.append(why)
        i = j
    # nanoserve serves one name: the first --served-model-name, else the model id the test passes
    name = served_names[0] if served_names else model
    if len(served_names) > 1:
        features.append("several --served-model-name aliases")
        dropped.append("--served-model-name extra aliases " + " ".join(served_names[1:]))
    # CPU speed: a server the test starts without --max-model-len would take the model's whole context (8192
    # here) as the limit of requests without max_tokens, ~5 min of CPU decoding each; cap it (vLLM's models stop
    # or run to their own, larger limit: such tests are model-dependent either way)
    if "--max-model-len" not in out and DEFAULT_MAX_MODEL_LEN:
        out += ["--max-model-len", DEFAULT_MAX_MODEL_LEN]
        dropped.append(f"(added --max-model-len {DEFAULT_MAX_MODEL_LEN})")
    out = ["--served-model-name", name, *out]
    return out, features, dropped


_LIVE_PROCS: dict[int, subprocess.Popen] = {}


def _kill_leftovers() -> None:
    """A fixture teardown skipped (timeout, interrupt) must not leave a server running past pytest."""
    for pid, proc in list(_LIVE_PROCS.items()):
        if proc.poll() is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass


import atexit  # noqa: E402

atexit.register(_kill_leftovers)


class RemoteOpenAIServer:
    """Drop-in for vLLM's RemoteOpenAIServer that launches `nanoserve serve` on the embedded default model."""

    DUMMY_API_KEY = "token-abc123"
    # every server started in this process: (model, features dropped) -- read by conftest for classification
    current_features: list[str] = []

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        vllm_serve_args = [str(a) for a in vllm_serve_args]
        if auto_port:
            if "-p" in vllm_serve_args or "--port" in vllm_serve_args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            if "--uds" not in vllm_serve_args:
                vllm_serve_args = vllm_serve_args + ["--port", str(get_open_port())]
        if seed is not None:
            if "--seed" in vllm_serve_args:
                raise ValueError(f"You have manually specified the seed when `seed={seed}`.")
            vllm_serve_args = vllm_serve_args + ["--seed", str(seed)]
        if override_hf_configs is not None:
            vllm_serve_args = vllm_serve_args + ["--hf-overrides", json.dumps(override_hf_configs)]
        if "--uds" in vllm_serve_args:
            raise RuntimeError("harness: --uds (unix socket) is not supported by nanoserve")

        args, features, dropped = translate_args(model, vllm_serve_args)
        self.model = model
        self.features = features
        self.dropped = dropped
        RemoteOpenAIServer.current_features = list(features)
        self.host = "127.0.0.1"
        self.port = None
        self.uds = None
        for k, a in enumerate(args):
            if a == "--port":
                self.port = int(args[k + 1])
            if a == "--host":
                self.host = args[k + 1]
        if self.port is None:
            self.port = 8000
            args += ["--port", "8000"]
        self.show_hidden_metrics = False

        env = os.environ.copy()
        if env_dict:
            env.update(env_dict)
        if NANOSERVE_SRC:
            env["PYTHONPATH"] = NANOSERVE_SRC
        else:
            env.pop("PYTHONPATH", None)
        # nanoserve reads VLLM_API_KEY as its key: only honour it when the test set it itself
        if not (env_dict and "VLLM_API_KEY" in env_dict):
            env.pop("VLLM_API_KEY", None)
        env.pop("NANOSERVE_API_KEY", None)
        os.makedirs(SERVER_LOG_DIR, exist_ok=True)
        test = os.environ.get("PYTEST_CURRENT_TEST", "unknown").split(" ")[0]
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in test)[-150:]
        self.log_path = os.path.join(SERVER_LOG_DIR, f"{int(time.time())}-{self.port}-{safe}.log")
        cmd = [NANOSERVE_BIN, "serve", *args]
        print(f"[harness] vllm serve {model} {' '.join(vllm_serve_args)}")
        print(f"[harness]   -> {' '.join(cmd)}")
        if dropped:
            print(f"[harness]   dropped: {dropped}  (features the test may rely on: {features})")
        self._log = open(self.log_path, "w")
        self._log.write(f"# vllm args: {vllm_serve_args}\n# nanoserve: {cmd}\n# dropped: {dropped}\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _LIVE_PROCS[self.proc.pid] = self.proc
        try:
            self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)
        except Exception:
            self._shutdown()
            raise

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self._shutdown()

    def _shutdown(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, OSError):
                    pass
                self.proc.wait(10)
        self._log.close()
        _LIVE_PROCS.pop(self.proc.pid, None)
        self.proc = None

    def _wait_for_server(self, *, url: str, timeout: float):
        start = time.time()
        while True:
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    return
            except Exception:
                pass
            rc = self.proc.poll()
            if rc is not None:
                tail = open(self.log_path).read()[-3000:]
                raise RuntimeError(f"Server exited unexpectedly (rc={rc}). Log tail:\n{tail}")
            time.sleep(0.5)
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def get_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0,
                                        **kwargs)


RemoteVLLMServer = RemoteOpenAIServer


class RemoteLaunchRenderServer(RemoteOpenAIServer):
    def __init__(self, *a, **k):
        import pytest
        pytest.skip("harness: `vllm launch render` (GPU-less render server) has no nanoserve counterpart")


class RemoteOpenAIServerCustom(RemoteOpenAIServer):
    def __init__(self, *a, **k):
        import pytest
        pytest.skip("harness: RemoteOpenAIServerCustom runs a custom vLLM child process")


def _not_available(name):
    def f(*a, **k):
        import pytest
        pytest.skip(f"harness: tests.utils.{name} needs vLLM internals")
    return f


for _n in ["compare_two_settings", "compare_all_settings", "multi_process_parallel", "fork_new_process_for_each_test",
           "create_new_process_for_each_test", "spawn_new_process_for_each_test", "wait_for_gpu_memory_to_clear"]:
    globals()[_n] = _not_available(_n)


def large_gpu_mark(min_gb: int):
    import pytest
    return pytest.mark.skip(reason="harness: large GPU test")


def multi_gpu_marks(*, num_gpus: int):
    import pytest
    return [pytest.mark.skip(reason="harness: multi GPU test")]


def set_random_seed(seed: int) -> None:
    import random
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
        import torch
        torch.manual_seed(seed)
    except Exception:
        pass
