"""The Hugging Face tokenizer the tiny checkpoints carry: SmolLM2's, exported by transformers from the default
model's GGUF file. Where that 98 MB file cannot go (the lent GPU machine), scripts/gpu-carry.sh carries the
exported files instead and NANOSERVE_TEST_TOKENIZER names them."""

from __future__ import annotations

import os
from pathlib import Path


def export_default_tokenizer(out: str | os.PathLike) -> Path:
    """Write the default model's tokenizer as a Hugging Face tokenizer directory at `out`."""
    from transformers import AutoTokenizer

    from nanoserve.model.loader import default_model_path

    path = default_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return Path(out)


def carried_tokenizer() -> Path | None:
    """The directory NANOSERVE_TEST_TOKENIZER names, when it is set (it must hold tokenizer.json)."""
    carried = os.environ.get("NANOSERVE_TEST_TOKENIZER")
    if not carried:
        return None
    if not (Path(carried) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"NANOSERVE_TEST_TOKENIZER={carried} holds no tokenizer.json")
    return Path(carried)


if __name__ == "__main__":  # python -m tests.tokenizer_source DIR (scripts/gpu-carry.sh)
    import sys

    print(export_default_tokenizer(sys.argv[1]))
