"""nanoserve: a small LLM inference engine (paged KV cache, continuous batching, OpenAI-compatible serving)."""

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
