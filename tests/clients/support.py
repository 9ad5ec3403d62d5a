"""Helpers for the client tests: where the clients' environment is, how a client runs, what the server saw,
and the offline answers (the engine's own and transformers') that a client's report is compared with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.server.serve import Server

HERE = Path(__file__).parent
ENV_VAR = "NANOSERVE_CLIENT_ENV"
REQUIRE_VAR = "NANOSERVE_REQUIRE_CLIENTS"
MODEL = "tiny"
MAX_MODEL_LEN = 512
RESPONSE_CAP = 2**20  # bytes of each answer kept; the largest here (lm-eval's echoed batches) are ~50 kB


def unavailable(reason: str):
    if os.environ.get(REQUIRE_VAR) == "1":
        pytest.fail(f"{reason} ({REQUIRE_VAR}=1 makes this a failure)", pytrace=False)
    pytest.skip(reason)


def client_tool(client_env: Path, name: str) -> Path:
    """A console script of the clients' environment (lm_eval, guidellm, schemathesis ...)."""
    tool = client_env / "bin" / name
    if not tool.exists():
        unavailable(f"{tool} is missing; rebuild the clients' environment with scripts/client-envs.sh")
    return tool


def client_environ(home: Path, bin_dir: Path) -> dict:
    """The environment a client runs in: its own environment's bin first on PATH, nothing from a hub, no
    telemetry, no cost map fetched, no proxy between it and loopback, caches in the test's own directory."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(home / "hf"), XDG_CACHE_HOME=str(home / "cache"), NO_PROXY="127.0.0.1,localhost",
        LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False", LANGSMITH_TRACING="false",
        LANGCHAIN_TRACING_V2="false", DO_NOT_TRACK="1", OPENAI_API_KEY="unused", TOKENIZERS_PARALLELISM="false",
        GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL="WARNING", GUIDELLM__MAX_WORKER_PROCESSES="2", PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class Exchange:
    """One HTTP request the server answered: what came in and what went out (cut at RESPONSE_CAP bytes)."""

    method: str
    path: str
    raw: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response: bytes = b""
    started: float = field(default_factory=time.monotonic)
    seconds: float | None = None  # from the request's arrival to its answer's last byte

    @property
    def request(self):
        try:
            return json.loads(self.raw) if self.raw else None
        except ValueError:
            return bytes(self.raw)

    def response_json(self):
        try:
            return json.loads(self.response)
        except ValueError:
            return None

    def describe(self, cap: int = 1500) -> str:
        took = "" if self.seconds is None else f" ({self.seconds:.1f}s)"
        return (f"{self.method} {self.path} {bytes(self.raw[:cap]).decode(errors='replace')}\n"
                f"  -> {self.status}{took} {self.response[:cap].decode(errors='replace')}")


@dataclass
class Recorder:
    """Every exchange the server answered, so a test can check what a client sent (a list of prompts in one
    request, continuous_usage_stats) and show what the server said when it refused."""

    exchanges: list[Exchange] = field(default_factory=list)

    def mark(self) -> int:
        return len(self.exchanges)

    def since(self, mark: int, path: str | None = None) -> list[Exchange]:
        return [e for e in self.exchanges[mark:] if path is None or e.path == path]

    def failures(self, mark: int = 0) -> str:
        """The first few refused or failed exchanges since `mark`, for a test's failure message."""
        bad = [e for e in self.exchanges[mark:] if e.status is None or e.status >= 400]
        if not bad:
            return "the server refused no request"
        return f"{len(bad)} exchange(s) refused; first ones:\n" + "\n".join(e.describe() for e in bad[:3])

    def slowest(self, mark: int = 0, count: int = 5) -> str:
        """The exchanges since `mark` that took longest, for a test that ran past its time."""
        timed = sorted((e for e in self.exchanges[mark:] if e.seconds is not None), key=lambda e: -e.seconds)
        total = sum(e.seconds for e in timed)
        return (f"{len(timed)} exchanges answered in {total:.0f}s of server time; slowest:\n"
                + "\n".join(e.describe(300) for e in timed[:count]))


class RecordingMiddleware:
    """Pure ASGI, outermost: sees each request body and the status and first bytes of each answer."""

    def __init__(self, app, recorder: Recorder):
        self.app, self.recorder = app, recorder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"])
        self.recorder.exchanges.append(exchange)

        async def receive_recorded():
            message = await receive()
            if message["type"] == "http.request":
                exchange.raw.extend(message.get("body", b""))
            return message

        async def send_recorded(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                if len(exchange.response) < RESPONSE_CAP:
                    exchange.response += message.get("body", b"")[:RESPONSE_CAP - len(exchange.response)]
                if not message.get("more_body", False):
                    exchange.seconds = time.monotonic() - exchange.started
            await send(message)

        await self.app(scope, receive_recorded, send_recorded)


@dataclass
class LiveServer:
    server: Server
    recorder: Recorder
    checkpoint: Path

    @property
    def url(self) -> str:
        return self.server.url


def engine_prompt_logprobs(llm: LLM, ids: list[int]) -> list[float | None]:
    """The engine's log probability of each prompt token given the ones before it (None for the first),
    read from the offline API's prompt_logprobs in vLLM's shape."""
    out = llm.generate({"prompt_token_ids": list(ids)}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None, lps
    return [None] + [lps[i][ids[i]].logprob for i in range(1, len(ids))]


def hf_prompt_logprobs(model, ids: list[int]) -> list[float | None]:
    """transformers' log_softmax of the logits at each position, gathered at the next prompt token."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def hf_argmax(model, ids: list[int]) -> list[int]:
    """transformers' most likely next token after each prompt position."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].argmax(-1).tolist()


def greedy_text(llm: LLM, prompt, max_tokens: int, stop=None, chat: bool = False) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
    if chat:
        return llm.chat(prompt, params, use_tqdm=False)[0].outputs[0].text
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


@dataclass
class Ran:
    returncode: int
    output: str
    seconds: float


def run_client(argv: list, home: Path, timeout: float, cwd: Path | None = None, check: bool = True,
               live: LiveServer | None = None, mark: int = 0) -> Ran:
    """Run one client command to completion, bounded by `timeout` (past it the client's whole process group,
    workers included, is killed); on a non-zero exit the test fails with the client's last output and the first
    exchanges the server refused."""
    home.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen([str(a) for a in argv], cwd=cwd or home, env=client_environ(home, Path(argv[0]).parent),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{argv[0]} ran past {timeout}s\n{output[-3000:]}\n"
                    f"{live.recorder.failures(mark) if live else ''}\n"
                    f"{live.recorder.slowest(mark) if live else ''}", pytrace=False)
    ran = Ran(proc.returncode, output, time.monotonic() - start)
    print(f"{Path(str(argv[0])).name} took {ran.seconds:.1f}s", file=sys.stderr)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv[:3]))} ... exited {proc.returncode}\n{output[-4000:]}\n"
                    f"{live.recorder.failures(mark) if live else ''}", pytrace=False)
    return ran
