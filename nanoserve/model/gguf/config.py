"""The Hugging Face config.json-shaped dict, rope scaling included, from a GGUF file's metadata (architectures
llama, qwen2, qwen3 and phi3: nanoserve/models/registry.py's GGUF_ARCHITECTURES)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf.reader import TensorInfo
from nanoserve.models.registry import GGUF_ARCHITECTURES

__all__ = ["gguf_architecture", "hf_config", "longrope_scaling", "rope_scaling"]


def _require(meta: dict, key: str, path: Path) -> Any:
    if key not in meta:
        raise CheckpointError(
            f"{path} lacks the metadata key {key!r}, which every GGUF of its architecture has; re-convert the model with "
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
    arch = meta.get("general.architecture")
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none")).lower()
    # Older files state linear scaling only as `rope.scale_linear`.
    factor = float(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 1.0)))
    if kind in ("none", "linear"):
        return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    raise CheckpointError(
        f"{path} uses {kind!r} rope scaling, which is not supported; supported: none, linear, and llama3 "
        "(a rope_freqs tensor). Use the Hugging Face checkpoint directory of this model instead"
    )


def longrope_scaling(meta: dict, long: torch.Tensor | None, short: torch.Tensor | None, config: dict,
                     path: Path) -> dict:
    """Phi-3's LongRoPE from the two factor tensors llama.cpp writes (rope_factors_long / _short), the original
    context and the attention factor from the metadata (as convert_hf_to_gguf.py writes them)."""
    half = config["head_dim"] // 2
    if long is None or short is None or long.numel() != half or short.numel() != half:
        raise CheckpointError(f"{path} has LongRoPE factor tensors that are not a long and a short one of head_dim / 2 "
                              f"= {half} values each; the file is inconsistent")
    arch = meta.get("general.architecture")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise CheckpointError(f"{path} has LongRoPE factors but no {arch}.rope.scaling.original_context_length; "
                              "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    out = {"rope_type": "longrope", "long_factor": long.flatten().tolist(), "short_factor": short.flatten().tolist(),
           "original_max_position_embeddings": int(original)}
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    return out if attn_factor is None else {**out, "attention_factor": float(attn_factor)}


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


def gguf_architecture(meta: dict, path: Path) -> str:
    """The file's general.architecture, refused unless the registry runs it."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path} is a GGUF file of architecture {arch!r}; GGUF files of architecture "
            f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)} are supported (Llama, SmolLM, Mistral in llama "
            "layout, Qwen2/Qwen2.5, Qwen3, Phi-3/Phi-4). For other models pass the Hugging Face checkpoint directory "
            "(config.json + *.safetensors) if nanoserve runs its architecture"
        )
    return str(arch)


def hf_config(meta: dict, infos: dict[str, TensorInfo], path: Path, dtype: torch.dtype) -> dict:
    """The config.json a Hugging Face checkpoint of this file would have. Metadata keys are prefixed with the
    file's architecture (`llama.`, `qwen2.`, `qwen3.`); Qwen2's qkv biases and Qwen3's q/k norms are read from
    the tensors the file holds."""
    arch = gguf_architecture(meta, path)
    key = f"{arch}.".__add__
    hidden = int(_require(meta, key("embedding_length"), path))
    heads = _single(_require(meta, key("attention.head_count"), path), "head_count", path)
    kv_heads = _single(meta.get(key("attention.head_count_kv"), heads), "head_count_kv", path)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise CheckpointError(
            f"{path} states {heads} attention heads and {kv_heads} kv heads; heads must be a positive multiple "
            "of kv heads, so the file is corrupt"
        )
    head_dim = int(meta.get(key("attention.key_length")) or meta.get(key("rope.dimension_count")) or hidden // heads)
    rope_dim = int(meta.get(key("rope.dimension_count"), head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path} rotates {rope_dim} of {head_dim} head dimensions (partial rotary); only full-head rotary "
            f"{arch} models are supported"
        )
    if int(meta.get(key("expert_count"), 0) or 0) > 0:
        raise CheckpointError(
            f"{path} is a mixture-of-experts model in the {arch} layout (e.g. Mixtral); only dense {arch} models "
            "are supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.get(key("vocab_size")) or len(tokens) or infos["token_embd.weight"].shape[0])
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _single(_require(meta, key("feed_forward_length"), path), "feed_forward_length", path),
        "num_hidden_layers": int(_require(meta, key("block_count"), path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_require(meta, key("attention.layer_norm_rms_epsilon"), path)),
        "rope_theta": float(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(_require(meta, key("context_length"), path)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in infos,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_scaling": None,  # filled in by load_gguf once rope_freqs (or LongRoPE's factors) is read
        "sliding_window": int(meta.get(key("attention.sliding_window")) or 0) or None,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",  # Qwen2's qkv biases; llama.cpp permutes a llama file's, so those are refused
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
