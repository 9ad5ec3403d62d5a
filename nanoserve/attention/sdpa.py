"""Scaled dot-product attention with grouped-query heads, on every supported torch version."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def _has_native_gqa() -> bool:
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: probe it
        q = torch.zeros(1, 2, 1, 4)
        try:
            F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_NATIVE_GQA = _has_native_gqa()


def sdpa(q, k, v, *, mask=None, causal=False, scale: float) -> torch.Tensor:
    """q: [..., heads, q_len, dim]; k/v: [..., kv_heads, kv_len, dim], heads a multiple of kv_heads.

    Uses torch's native grouped-query support where it exists (torch >= 2.5) instead of repeating K/V.
    """
    group = q.shape[-3] // k.shape[-3]
    if group > 1 and not _NATIVE_GQA:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    kwargs = {"enable_gqa": True} if group > 1 and _NATIVE_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **kwargs)
