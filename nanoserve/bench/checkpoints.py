"""Random-weight Llama checkpoints of a chosen shape, for benchmarks that need a shape or a size the default model
lacks. Random weights make random text; a step's cost is that of a real model of the shape.

The tokenizer is the default model's (read from its GGUF file), or a Hugging Face tokenizer directory holding a
copy of it where that file is not at hand (the lent GPU machine: scripts/gpu-carry.sh carries one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.optional import require


def load_tokenizer(tokenizer: str | None):
    """transformers' tokenizer from `tokenizer` (a directory), else the default model's GGUF file."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    from nanoserve.model.loader import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def write_random_llama(out: str | Path, shape: dict, dtype: torch.dtype = torch.float32,
                       tokenizer: str | None = None, device: str = "cpu", feature: str = "a random checkpoint") -> int:
    """A LlamaForCausalLM of `shape` (LlamaConfig's keywords; the vocabulary defaults to the tokenizer's), seeded,
    written with its tokenizer to `out`. Returns its parameter count."""
    require("transformers", feature)
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer)
    config = LlamaConfig(**{"vocab_size": len(tok), "bos_token_id": 1, "eos_token_id": 2, **shape})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())
