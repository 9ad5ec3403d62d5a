"""nanoserve: a small LLM inference engine (paged KV cache, continuous batching, OpenAI-compatible serving).

The root is light: it chooses Triton's mode (before anything can import Triton) and names the public API, whose
modules load on first use. So `nanoserve --help`, a kernel module or a test helper does not import the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nanoserve import triton_env as _triton_env  # noqa: F401  (first: it sets TRITON_INTERPRET)

if TYPE_CHECKING:
    from nanoserve.beam_search import BeamSearchParams
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine
    from nanoserve.llm import LLM
    from nanoserve.outputs import CompletionOutput, RequestOutput
    from nanoserve.sampling import SamplingParams
    from nanoserve.structured.params import StructuredOutputsParams

_PUBLIC = {
    "LLM": "nanoserve.llm",
    "Engine": "nanoserve.engine",
    "EngineConfig": "nanoserve.config",
    "SamplingParams": "nanoserve.sampling",
    "StructuredOutputsParams": "nanoserve.structured.params",
    "RequestOutput": "nanoserve.outputs",
    "CompletionOutput": "nanoserve.outputs",
    "BeamSearchParams": "nanoserve.beam_search",
}
__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "BeamSearchParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`from nanoserve import LLM` imports the module that defines it, the first time it is asked for."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
