"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K, Q2_K, Q3_K) and the IQ4 types written from float weights in numpy,
for tiny test files.

The gguf package decodes these types but cannot write them; llama.cpp's quantizer can, but CI's main
environment has no llama.cpp. This is a plain min/max encoder (not llama.cpp's error-minimising search): any
valid blocks serve, since the oracle is gguf's own dequantization of the bytes written.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block -> gguf's 12 bytes (the inverse of get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _k45(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per super-block: f16 d and dmin, 6-bit scales and mins, and codes 0..levels per sub-block of 32."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / levels, -low
    d = np.maximum(scale.max(-1), 1e-8) / 63
    dmin = np.maximum(mins.max(-1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d16[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin16[:, None]), 0, 63).astype(np.uint8)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(np.round((sub + (dmin16[:, None] * m)[..., None]) / step), 0, levels).astype(np.uint8)
    return _f16(d), _f16(dmin), _scales_k4(sc, m), q.reshape(-1, QK)


def q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k45(x, 15)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k45(x, 31)
    sub = q.reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((sub[:, j] >> 4) & 1) << j
    low = sub & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(np.abs(scale).max(-1), 1e-8) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    # signed scales, as llama.cpp writes them: negative where a sub-block's largest magnitude is negative
    largest = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    sign = np.where(largest < 0, -1, 1)
    sc = (sign * np.clip(np.round(scale / d16[:, None]), 1, 127)).astype(np.int8)
    step = (d16[:, None] * sc)[..., None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for s in range(2):
        ql |= (q[:, :, 64 * s:64 * s + 64] & 15) << (4 * s)
    for t in range(4):
        qh |= (q[:, :, 32 * t:32 * t + 32] >> 4) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)


KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _nearest_kvalue(scaled: np.ndarray) -> np.ndarray:
    return np.abs(scaled[..., None] - KVALUES).argmin(-1).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[..., 32] codes -> [..., 16] bytes: code j in byte j's low nibble, code j + 16 in its high one."""
    return q[..., :16] | (q[..., 16:] << 4)


def iq4_nl(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 32)
    d16 = (np.maximum(np.abs(sub).max(-1), 1e-8) / 127).astype(np.float16)
    q = _nearest_kvalue(sub / d16.astype(np.float32)[:, None])
    return np.concatenate([d16.view(np.uint8).reshape(-1, 2), _nibble_pairs(q)], axis=1).reshape(-1, 8 * 18)


def iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32)
    scale = np.maximum(np.abs(sub).max(-1), 1e-8) / 127
    d16 = (scale.max(-1) / 31).astype(np.float16)
    d = d16.astype(np.float32)
    ls = np.clip(np.round(scale / d[:, None]), 1, 31).astype(np.int32) + 32  # stored 6-bit, meaning ls - 32
    q = _nearest_kvalue(sub / (d[:, None] * (ls - 32))[..., None])
    high = np.zeros(sub.shape[0], dtype=np.uint16)
    for b in range(8):
        high |= ((ls[:, b] >> 4) & 3).astype(np.uint16) << (2 * b)
    low = (ls & 15).astype(np.uint8)
    return np.concatenate([d16.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2),
                           low[:, 0::2] | (low[:, 1::2] << 4), _nibble_pairs(q).reshape(-1, 128)], axis=1)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """[n, 256] codes 0..3 -> [n, 64] bytes: input 128 h + 32 s + l in bits 2 s of byte 32 h + l."""
    parts = q.reshape(-1, 2, 4, 32)
    out = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for s in range(4):
        out |= parts[:, :, s] << (2 * s)
    return out.reshape(-1, 64)


def q2_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / 3, -low
    d16 = (np.maximum(scale.max(-1), 1e-8) / 15).astype(np.float16)
    dmin16 = (np.maximum(mins.max(-1), 1e-8) / 15).astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.round(scale / d[:, None]), 1, 15).astype(np.uint8)
    m = np.clip(np.round(mins / dmin[:, None]), 0, 15).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin[:, None] * m)[..., None]) / (d[:, None] * sc)[..., None]), 0, 3)
    return np.concatenate([sc | (m << 4), _two_bit_planes(q.astype(np.uint8).reshape(-1, QK)),
                           d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2)], axis=1)


def q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.maximum(np.abs(sub).max(-1), 1e-8) / 4
    d16 = (scale.max(-1) / 31).astype(np.float16)
    d = d16.astype(np.float32)
    ls = np.clip(np.round(scale / d[:, None]), 1, 31).astype(np.int32) + 32  # stored 6-bit, meaning ls - 32
    q = np.clip(np.round(sub / (d[:, None] * (ls - 32))[..., None]), -4, 3).astype(np.int32) + 4  # 0..7
    q = q.reshape(-1, QK)
    hmask = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= ((q[:, 32 * bit:32 * bit + 32] >> 2) & 1).astype(np.uint8) << bit
    scales = np.zeros((q.shape[0], 12), dtype=np.uint8)
    for i in range(16):
        scales[:, i % 8] |= ((ls[:, i] & 15) << (4 * (i // 8))).astype(np.uint8)
        scales[:, 8 + i % 4] |= (((ls[:, i] >> 4) & 3) << (2 * (i // 4))).astype(np.uint8)
    return np.concatenate([hmask, _two_bit_planes((q & 3).astype(np.uint8)), scales,
                           d16.view(np.uint8).reshape(-1, 2)], axis=1)


ENCODERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs, "Q2_K": q2_k,
            "Q3_K": q3_k}


def encode_k(arr: np.ndarray, qtype: str) -> np.ndarray:
    """A [rows, cols] float array (cols a multiple of 256) as the type's blocks, [rows, cols / 256 * bytes]."""
    rows, cols = arr.shape
    if cols % QK:
        raise ValueError(f"{qtype} needs columns in whole super-blocks of {QK}, not {cols}")
    return ENCODERS[qtype](arr.astype(np.float32).reshape(-1, QK)).reshape(rows, -1)
