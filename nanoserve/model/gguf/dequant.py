"""GGUF quantization types and their decoding into float32 numpy arrays."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

__all__ = ["SUPPORTED_QUANT_TYPES", "dequantize"]

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
