"""The model registry: a checkpoint's architecture name -> the file and class that implement it.

Adding an architecture is its file in nanoserve/models/ and one line here. `family` is how its config is read
(nanoserve/model/config.py): Qwen2's qkv biases by default, Qwen3's per-head q/k norms, Phi-3's original context.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    module: str  # nanoserve.models.<module>
    cls: str
    family: str


ARCHITECTURES = {
    "LlamaForCausalLM": Entry("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": Entry("llama", "LlamaForCausalLM", "llama"),
    "Qwen2ForCausalLM": Entry("llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": Entry("llama", "LlamaForCausalLM", "qwen3"),
    "Phi3ForCausalLM": Entry("phi3", "Phi3ForCausalLM", "phi3"),
}

# a GGUF file's general.architecture -> the Hugging Face architecture its tensors and metadata describe
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM"}


def model_class(architecture: str) -> type:
    """The class that runs `architecture` (imported on first use: a registry line costs no import)."""
    entry = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"nanoserve.models.{entry.module}"), entry.cls)
