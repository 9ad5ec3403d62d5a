"""Load a llama-architecture GGUF file (llama.cpp's format) as a Hugging Face-style checkpoint.

`load_gguf` returns a config.json-shaped dict, HF-named tensors in the HF layout and a `tokenizers.Tokenizer`,
so the rest of the engine never needs to know the weights came from GGUF.
"""

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf.checkpoint import GGUFCheckpoint, load_gguf
from nanoserve.model.gguf.dequant import SUPPORTED_QUANT_TYPES, dequantize

__all__ = ["CheckpointError", "GGUFCheckpoint", "SUPPORTED_QUANT_TYPES", "dequantize", "load_gguf"]
