"""Load a GGUF file (architectures llama, qwen2, qwen3) (llama.cpp's format) as a Hugging Face-style checkpoint.

`load_gguf` returns a config.json-shaped dict, HF-named tensors in the HF layout and a `tokenizers.Tokenizer`,
so the rest of the engine never needs to know the weights came from GGUF. `read_gguf_header` and
`read_gguf_weights` are its two halves, for a loader that builds the model in between.
"""

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf.checkpoint import (
    GGUFCheckpoint,
    GGUFHeader,
    load_gguf,
    read_gguf_header,
    read_gguf_weights,
)
from nanoserve.model.gguf.dequant import SUPPORTED_QUANT_TYPES, dequantize

__all__ = ["CheckpointError", "GGUFCheckpoint", "GGUFHeader", "SUPPORTED_QUANT_TYPES", "dequantize", "load_gguf",
           "read_gguf_header", "read_gguf_weights"]
