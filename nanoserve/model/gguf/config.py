"""The Hugging Face config.json-shaped dict, rope scaling included, from a llama GGUF file's metadata."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf.reader import TensorInfo

__all__ = ["hf_config", "rope_scaling"]


def _require(meta: dict, key: str, path: Path) -> Any:
    if key not in meta:
        raise CheckpointError(
            f"{path} lacks the metadata key {key!r}, which every llama GGUF has; re-convert the model with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    return meta[key]


def _single(value: Any, key: str, path: Path) -> int:
    """Per-layer arrays (e.g. head counts) must be uniform for the plain llama decoder."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(
                f"{path} gives {key} per layer ({sorted(set(value))}); only uniform llama layers are supported"
            )
        value = value[0]
    return int(value)


def rope_scaling(meta: dict, rope_freqs: torch.Tensor | None, head_dim: int, theta: float,
                  path: Path) -> dict | None:
    """HF `rope_scaling` from the metadata, or recovered from the `rope_freqs` tensor llama.cpp writes
    for Llama 3.1+ instead of metadata."""
    if rope_freqs is not None:
        return _llama3_scaling(rope_freqs, head_dim, theta, path)
    kind = str(meta.get("llama.rope.scaling.type", "none")).lower()
    # Older files state linear scaling only as `rope.scale_linear`.
    factor = float(meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear", 1.0)))
    if kind in ("none", "linear"):
        return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    raise CheckpointError(
        f"{path} uses {kind!r} rope scaling, which is not supported; supported: none, linear, and llama3 "
        "(a rope_freqs tensor). Use the Hugging Face checkpoint directory of this model instead"
    )


def _llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float, context: int):
    """llama.cpp's convert_hf_to_gguf.py formula for the llama3 rope_freqs tensor."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < context / high, torch.ones_like(mid), torch.where(wavelen > context / low, factor, mid))


def _llama3_scaling(rope_freqs: torch.Tensor, head_dim: int, theta: float, path: Path) -> dict | None:
    """Find the llama3 parameters that reproduce `rope_freqs`.

    The tensor fixes the factor (its maximum) and, given Meta's low/high frequency factors (1 and 4, used
    by every Llama 3.x), the original context length; anything else is refused rather than guessed.
    """
    freqs = rope_freqs.float().flatten()
    if freqs.numel() != head_dim // 2:
        raise CheckpointError(
            f"{path} has a rope_freqs tensor of {freqs.numel()} values but head_dim {head_dim} needs "
            f"{head_dim // 2}; the file is inconsistent"
        )
    if torch.allclose(freqs, torch.ones_like(freqs)):
        return None
    factor = float(freqs.max())
    low, high = 1.0, 4.0
    wavelen = 2 * math.pi / (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)))
    candidates = [8192]
    mid = (freqs > 1) & (freqs < factor)
    if factor > 1 and mid.any():
        smooth = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)
        candidates = [round(float(c)) for c in wavelen[mid] * (smooth * (high - low) + low)] + candidates
    for context in candidates:
        expect = _llama3_rope_factors(head_dim, theta, factor, low, high, context)
        if torch.allclose(expect, freqs, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": context,
            }
    raise CheckpointError(
        f"{path} has a rope_freqs tensor that is not llama3 rope scaling (factor {factor:g}, low/high "
        "frequency factors 1/4); only llama3 rope_freqs are supported. Use the Hugging Face checkpoint "
        "directory of this model instead"
    )


def hf_config(meta: dict, infos: dict[str, TensorInfo], path: Path, dtype: torch.dtype) -> dict:
    hidden = int(_require(meta, "llama.embedding_length", path))
    heads = _single(_require(meta, "llama.attention.head_count", path), "head_count", path)
    kv_heads = _single(meta.get("llama.attention.head_count_kv", heads), "head_count_kv", path)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise CheckpointError(
            f"{path} states {heads} attention heads and {kv_heads} kv heads; heads must be a positive multiple "
            "of kv heads, so the file is corrupt"
        )
    head_dim = int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads)
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path} rotates {rope_dim} of {head_dim} head dimensions (partial rotary); only full-head rotary "
            "llama models are supported"
        )
    if int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise CheckpointError(
            f"{path} is a mixture-of-experts model in the llama layout (e.g. Mixtral); only dense llama models "
            "are supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.get("llama.vocab_size") or len(tokens) or infos["token_embd.weight"].shape[0])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _single(_require(meta, "llama.feed_forward_length", path), "feed_forward_length", path),
        "num_hidden_layers": int(_require(meta, "llama.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_require(meta, "llama.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_require(meta, "llama.context_length", path)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in infos,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_scaling": None,  # filled in by load_gguf once rope_freqs (if any) is read
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
