"""nanoserve: a small LLM inference engine (paged KV cache, continuous batching, OpenAI-compatible serving)."""

import os as _os
import sys as _sys

import torch as _torch

# Triton imported before this, outside its interpreter, cannot run the streamed read on a CPU (it says so).
TRITON_COMPILED_EARLY = "triton" in _sys.modules and _os.environ.get("TRITON_INTERPRET") != "1"
if not _torch.cuda.is_available():
    # Triton reads this when it is first imported (torch may import it lazily, e.g. through torch._dynamo), and
    # without CUDA its interpreter is the only way its kernels run: choose it before anything imports Triton.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.engine import Engine  # noqa: E402
from nanoserve.llm import LLM  # noqa: E402
from nanoserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanoserve.sampling import SamplingParams  # noqa: E402
from nanoserve.structured.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
