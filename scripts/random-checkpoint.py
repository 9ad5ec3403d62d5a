"""Write a random-weight Llama checkpoint of a chosen shape, with the default model's tokenizer.

    python scripts/random-checkpoint.py --out /tmp/llama-8h [--heads 8 --kv-heads 4 --layers 30 ...]

For benchmarks that need a shape the default model lacks (its 9 heads over 3 kv heads split across 1 or 3
tensor-parallel ranks only): the default is the default model's size with 8 heads over 4 kv heads, so 2 and 4
ranks divide it. Random weights make random text; the step costs are those of a real model of the shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()

    import torch

    from nanoserve.errors import NanoserveError
    from nanoserve.model.loader import default_model_path
    from nanoserve.optional import require

    try:
        require("transformers", "scripts/random-checkpoint.py")
    except NanoserveError as e:
        print(f"random-checkpoint: error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
