"""Load a llama-architecture GGUF file (llama.cpp's format) as Hugging Face-named tensors plus a tokenizer.

The result looks like a Hugging Face checkpoint: a config.json-shaped dict, `model.layers.N...` tensors in
the HF layout (llama.cpp's rotary row permutation of q/k undone) and a `tokenizers.Tokenizer` rebuilt from
the `tokenizer.ggml.*` metadata, so the rest of the engine never needs to know the weights came from GGUF.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from nanoserve.errors import CheckpointError

__all__ = ["CheckpointError", "GGUFCheckpoint", "SUPPORTED_QUANT_TYPES", "load_gguf"]


@dataclass(frozen=True)
class GGUFCheckpoint:
    """Everything a GGUF file holds, in Hugging Face terms.

    The tokenizer adds no special tokens by itself: prepend `bos_token` when `add_bos_token` is set.
    """

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


# --------------------------------------------------------------------------------------------------
# Quantization types
# --------------------------------------------------------------------------------------------------

# Types decoded here (lean numpy, bit-identical to gguf's reference); the rest go to gguf.quants.dequantize.
_FAST_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# Weight formats worth offering; each is kept only if the installed gguf package can decode it.
_CANDIDATE_TYPES = (
    *_FAST_TYPES, "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4",
)


def _gguf_can_decode(name: str) -> bool:
    """Whether gguf.quants.dequantize handles this type (probed on one zero block: no private API)."""
    qtype = getattr(GGMLQuantizationType, name, None)
    if qtype is None or qtype not in GGML_QUANT_SIZES:
        return False
    if name in _FAST_TYPES:
        return True
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        gguf_dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError, AttributeError):
        return False
    return True


SUPPORTED_QUANT_TYPES: tuple[str, ...] = tuple(n for n in _CANDIDATE_TYPES if _gguf_can_decode(n))


# Dequantization runs in numpy on purpose: it is single-threaded, so it neither gains nor loses from
# torch's intra-op threads, which on a busy machine turn ~2000 small elementwise ops into seconds of waiting.

def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 stored at byte `start` of every block, as a float32 column."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """4-bit values as float32: ggml packs element j in the low nibble and element j + 16 in the high
    nibble of byte j. Written straight into the output to spare passes over the largest tensors."""
    half = qs.shape[1]
    out = np.empty((qs.shape[0], 2 * half), dtype=np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :half], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, half:], casting="unsafe")
    return out


# Each decoder does gguf's arithmetic in gguf's order (scale * q, then + min), so results are bit-identical.
def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 34)  # f16 scale, 32 x int8
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16_column(b, 0)


def _dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 18)  # f16 scale, 16 bytes of 4-bit values offset by 8
    out = _nibbles(b[:, 2:])
    out -= 8
    out *= _f16_column(b, 0)
    return out


def _dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 20)  # f16 scale, f16 min, 16 bytes of 4-bit values
    out = _nibbles(b[:, 4:])
    out *= _f16_column(b, 0)
    out += _f16_column(b, 2)
    return out


_FAST_DEQUANT = {
    "F32": lambda raw: raw.view(np.float32),
    "F16": lambda raw: raw.view(np.float16).astype(np.float32),
    "BF16": lambda raw: (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor's raw bytes (flat uint8) into float32 of torch-order `shape` (ggml's dims reversed)."""
    fast = _FAST_DEQUANT.get(qtype.name)
    if fast is not None:
        return fast(raw).reshape(shape)
    return gguf_dequantize(raw.reshape(math.prod(shape[:-1]), -1), qtype).reshape(shape)


# --------------------------------------------------------------------------------------------------
# The file format
# --------------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml's ne[] reversed
    qtype: GGMLQuantizationType | int  # an int when this gguf package does not know the type
    offset: int  # absolute, in bytes from the start of the file

    @property
    def type_name(self) -> str:
        return self.qtype.name if isinstance(self.qtype, GGMLQuantizationType) else f"ggml type {self.qtype}"

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block_size * type_size


class _Reader:
    """A cursor over the mapped file. Parsing by hand keeps a 49k-token vocabulary to ~0.1 s
    (gguf.GGUFReader builds a numpy view per string and takes seconds)."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise struct.error("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """A string array (the vocabulary, the merges): the hot loop of parsing, kept tight."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            (n,) = length(buf, pos)
            if pos + 8 + n > size:
                raise struct.error("string runs past the end of the file")
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type == _STRING:
                return self.strings(count)
            if item_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item_type])
                raw = self.buf[self.pos:self.pos + count * dtype.itemsize]
                self.pos += count * dtype.itemsize
                return np.frombuffer(raw, dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise CheckpointError(
            f"{self.path} has a metadata value of unknown type {vtype}; the file is corrupt or from a newer "
            "GGUF version than this loader reads (v2/v3)"
        )


def _parse(path: Path) -> tuple[dict[str, Any], list[_TensorInfo]]:
    """Metadata and tensor table of a GGUF file (no tensor data is read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF":
            raise CheckpointError(
                f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes); pass a .gguf file "
                "made by llama.cpp's converter, or a Hugging Face checkpoint directory (config.json + *.safetensors)"
            )
        version = struct.unpack("<I", head[4:])[0]
        if version not in (2, 3):
            hint = "big-endian GGUF files are not supported; use the little-endian file" if version >= 1 << 16 \
                else "re-convert the model with a current llama.cpp (GGUF v3)"
            raise CheckpointError(f"{path} is GGUF version {version}; this loader reads v2 and v3: {hint}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, path)
            r.pos = 8
            try:
                n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
                meta = {}
                for _ in range(n_kv):
                    key = r.string()
                    meta[key] = r.value(r.unpack("<I"))
                raw_infos = []
                for _ in range(n_tensors):
                    name = r.string()
                    dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
                    raw_infos.append((name, tuple(reversed(dims)), r.unpack("<I"), r.unpack("<Q")))
            except struct.error:
                raise CheckpointError(
                    f"{path} is truncated or corrupt (its header runs past the end of the file); download or "
                    "convert it again"
                ) from None
            alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
            if alignment <= 0:
                raise CheckpointError(f"{path} states general.alignment={alignment}; the file is corrupt")
            data_start = -(-r.pos // alignment) * alignment
            size = len(buf)
    infos = []
    for name, shape, type_id, offset in raw_infos:
        try:
            qtype: GGMLQuantizationType | int = GGMLQuantizationType(type_id)
        except ValueError:
            qtype = type_id
        info = _TensorInfo(name, shape, qtype, data_start + offset)
        if info.type_name in SUPPORTED_QUANT_TYPES and info.offset + info.nbytes > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} runs past the end; download it again")
        infos.append(info)
    return meta, infos


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

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


def _rope_scaling(meta: dict, rope_freqs: torch.Tensor | None, head_dim: int, theta: float,
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


def _config(meta: dict, infos: dict[str, _TensorInfo], path: Path, dtype: torch.dtype) -> dict:
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


# --------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _expected_tensors(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, HF shape) for every tensor a dense llama model must have."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_norm": (h,), "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}
    out = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, h)), "output_norm.weight": ("model.norm.weight", (h,))}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (vocab, h))
    for i in range(cfg["num_hidden_layers"]):
        for gguf_leaf, hf_leaf in _LAYER_TENSORS.items():
            out[f"blk.{i}.{gguf_leaf}.weight"] = (f"model.layers.{i}.{hf_leaf}.weight", shapes[gguf_leaf])
    return out


def _undo_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf.py's `permute` of q/k rows (HF's rotate-half layout -> ggml's interleaved
    pairs), exactly as transformers' GGUF loader does."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_tensor(f, info: _TensorInfo) -> np.ndarray:
    raw = np.empty(info.nbytes, dtype=np.uint8)
    f.seek(info.offset)
    if f.readinto(memoryview(raw)) != info.nbytes:
        raise CheckpointError(f"{f.name} is truncated: tensor {info.name} runs past the end; download it again")
    return dequantize(raw, info.qtype, info.shape)


def _to_torch(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:  # numpy rounds to half exactly as torch does, without torch's thread pool
        w = w.astype(np.float16)
    t = torch.from_numpy(np.ascontiguousarray(w))
    return t if t.dtype == dtype else t.to(dtype)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex, as transformers' GGUF tokenizer conversion maps them. Any other value
# gets the GPT-2 regex of the ByteLevel pre-tokenizer.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp's LLAMA3 pre-tokenizer family: a word that is itself a token is taken whole, skipping the merges
# (the Llama 3 tokenizer.json's `ignore_merges`), and BOS is added unless the file says otherwise.
_LLAMA3_FAMILY = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
# Values known to want the GPT-2 regex itself (byte-level vocabularies without multi-digit merges split
# digits alike with or without llama.cpp's extra `\p{N}` rule, so starcoder/smollm belong here too).
_KNOWN_GPT2_REGEX = {"default", "gpt2", "smollm", "starcoder", "refact", "olmo", "mpt"}
_SUPPORTED_TOKENIZERS = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _merge_pairs(merges: list[str], path: Path) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut < 0:
            raise CheckpointError(f"{path} has a malformed tokenizer merge {m!r}; the tokenizer metadata is corrupt")
        pairs.append((m[:cut], m[cut + 1:]))
    return pairs


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score
    first (transformers' `generate_merges`, so both tokenize alike)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        found.extend(local)
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], path: Path, **kwargs) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", **kwargs)
    except Exception as e:  # tokenizers raises a bare Exception for merges naming unknown tokens
        raise CheckpointError(f"{path} has inconsistent tokenizer metadata ({e}); the file is corrupt") from None


def _byte_level_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path) -> Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens outside the byte alphabet (rare mislabels) are respelled byte by byte, as transformers does.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges") or [], path)
    tok = Tokenizer(_bpe(vocab, merges, path, fuse_unk=False, byte_fallback=False,
                         ignore_merges=pre in _LLAMA3_FAMILY))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _KNOWN_GPT2_REGEX:
            warnings.warn(f"{path}: no pre-tokenizer rule for tokenizer.ggml.pre={pre!r}; using GPT-2's split "
                          "regex, so tokenization may differ from llama.cpp's", stacklevel=3)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control tokens outside the byte alphabet are llama.cpp mislabels; adding them would grow the vocab.
    control = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL and t and set(t) <= spelled]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _sentencepiece_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral) as a byte-fallback BPE, like transformers builds."""
    if "tokenizer.ggml.merges" in meta:
        merges = _merge_pairs(meta["tokenizer.ggml.merges"], path)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise CheckpointError(
                f"{path} has a SentencePiece vocabulary with neither merges nor one score per token; the "
                "tokenizer metadata is incomplete, re-convert the model with llama.cpp"
            )
        merges = _merges_from_scores(tokens, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(_bpe(vocab, merges, path, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL and t])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED and t])
    return tok


def _tokenizer(meta: dict, path: Path) -> tuple[Tokenizer, bool]:
    """The tokenizer and whether BOS is prepended (llama.cpp's default when the file does not say)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        what = f"tokenizer model {kind!r}" if tokens else "no tokenizer vocabulary"
        raise CheckpointError(
            f"{path} has {what}; supported GGUF tokenizers: {_SUPPORTED_TOKENIZERS}. Use the Hugging Face "
            "checkpoint directory (with tokenizer.json) of this model instead"
        )
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path} has {len(tokens)} tokens but {len(types)} token types; the tokenizer metadata is corrupt, "
            "download or convert the file again"
        )
    if kind == "gpt2":
        tok = _byte_level_tokenizer(meta, tokens, types, path)
        default_bos = meta.get("tokenizer.ggml.pre") in _LLAMA3_FAMILY
    else:
        tok = _sentencepiece_tokenizer(meta, tokens, types, path)
        default_bos = True
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))


def _token(meta: dict, key: str) -> str | None:
    tokens, idx = meta.get("tokenizer.ggml.tokens") or [], meta.get(key)
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Read a llama-architecture GGUF file into HF-named tensors of `dtype` (dequantized), an HF-shaped
    config dict and a tokenizer. Refuses, with a CheckpointError naming the fix, anything it cannot load
    exactly."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist; pass the path of an existing .gguf file")
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a directory, not a GGUF file; pass a .gguf file here (Hugging Face checkpoint "
            "directories load through the safetensors loader)"
        )
    meta, info_list = _parse(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{path} is a GGUF file of architecture {arch!r}; GGUF files of architecture 'llama' are supported "
            "(Llama, SmolLM, Mistral in llama layout). For Llama, Mistral, Qwen2 or Qwen3 models pass the Hugging "
            "Face checkpoint directory (config.json + *.safetensors) instead"
        )
    bad = sorted({i.type_name for i in info_list if i.type_name not in SUPPORTED_QUANT_TYPES})
    if bad:
        raise CheckpointError(
            f"{path} stores tensors as {', '.join(bad)}, which this loader cannot dequantize; supported types: "
            f"{', '.join(SUPPORTED_QUANT_TYPES)}. Use a file quantized to one of those (e.g. Q4_K_M, Q8_0, F16)"
        )
    infos = {i.name: i for i in info_list}
    if "token_embd.weight" not in infos:
        raise CheckpointError(f"{path} has no token_embd.weight tensor; the file is incomplete, download it again")
    config = _config(meta, infos, path, dtype)
    expected = _expected_tensors(config)
    missing = sorted(set(expected) - set(infos))
    extra = sorted(set(infos) - set(expected) - {"rope_freqs.weight"})
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors of a llama model, e.g. {missing[:3]}; the "
                              "file is incomplete or not a plain llama model")
    if extra:
        raise CheckpointError(
            f"{path} has tensors a plain llama model does not use, e.g. {extra[:3]} (biases, experts or extra "
            "norms); only dense llama models without biases are supported"
        )
    for name, (_, shape) in expected.items():
        if infos[name].shape != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(infos[name].shape)} but the metadata implies "
                f"{list(shape)}; the file is inconsistent"
            )

    # Everything that can refuse the file runs before the (comparatively slow) dequantization.
    tokenizer, add_bos = _tokenizer(meta, path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        rope_freqs = _to_torch(_read_tensor(f, infos["rope_freqs.weight"]), torch.float32) \
            if "rope_freqs.weight" in infos else None
        config["rope_scaling"] = _rope_scaling(meta, rope_freqs, config["head_dim"], config["rope_theta"], path)
        for name, (hf_name, _) in expected.items():
            w = _read_tensor(f, infos[name])
            if name.endswith(".attn_q.weight"):
                w = _undo_rope_permute(w, heads)
            elif name.endswith(".attn_k.weight"):
                w = _undo_rope_permute(w, kv_heads)
            tensors[hf_name] = _to_torch(w, dtype)
    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=_token(meta, "tokenizer.ggml.bos_token_id"),
        eos_token=_token(meta, "tokenizer.ggml.eos_token_id"),
        add_bos_token=add_bos,
    )
