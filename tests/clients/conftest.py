"""Fixtures for driving third-party clients against a live nanoserve server on loopback.

The clients (lm-eval, guidellm, litellm, langchain-openai, schemathesis) live in their own virtual environment,
built by scripts/client-envs.sh and found through NANOSERVE_CLIENT_ENV; each runs as a subprocess of that
environment's interpreter while the server runs in this process, so every assertion can compare what a client
reported with the engine's own offline answer. Without the environment these tests skip and say how to get it;
with NANOSERVE_REQUIRE_CLIENTS=1 (CI) they fail instead. Every exchange the server saw is recorded, and a failing
test prints the first refused request with the server's answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanoserve import LLM, EngineConfig
from nanoserve.server.serve import Server

from .support import (
    ENV_VAR,
    HERE,
    MAX_MODEL_LEN,
    MODEL,
    LiveServer,
    Recorder,
    RecordingMiddleware,
    unavailable,
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.clients)


@pytest.fixture(scope="session")
def client_env() -> Path:
    """The clients' virtual environment, or a skip (a failure under NANOSERVE_REQUIRE_CLIENTS=1)."""
    where = os.environ.get(ENV_VAR)
    if not where:
        unavailable(f"{ENV_VAR} is not set; build the clients' environment with scripts/client-envs.sh and "
                    f"export {ENV_VAR}=<its directory>")
    env = Path(where)
    if not (env / "bin" / "python").exists():
        unavailable(f"{ENV_VAR}={where} has no bin/python; rebuild it with scripts/client-envs.sh {where}")
    return env


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint("llama"))


@pytest.fixture(scope="package")  # package scope: gone before the rest of the suite, which counts engine threads
def live(tiny_dir):
    """One server on 127.0.0.1 for every client test, on the tiny random Llama, with its exchanges recorded."""
    config = EngineConfig(model=str(tiny_dir), max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.02)
    server = Server(config, port=0, served_model_name=MODEL)
    recorder = Recorder()
    server.app.add_middleware(RecordingMiddleware, recorder=recorder)
    server.start()
    yield LiveServer(server, recorder, tiny_dir)
    server.stop()


@pytest.fixture(scope="package")
def offline(tiny_dir):
    """The same checkpoint through the offline API: the answer every client's report is compared with."""
    return LLM(model=str(tiny_dir), max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.02)


@pytest.fixture(scope="package")
def hf_model(tiny_dir):
    """transformers' own model on the same weights in float32: the oracle for the engine's logprobs."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype="float32").eval()


@pytest.fixture(scope="package")
def hf_tokenizer(tiny_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


