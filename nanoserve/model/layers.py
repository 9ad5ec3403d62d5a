"""The decoder's building blocks: norm, activation, rotary embedding, and the merged projections that load by
mapping. A layer that has a fused CPU kernel is given the kernels (or None) when it is built, at load: which code
runs is decided then, once, from the machine and the model's dtype, and a model's forward is one path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.attrs import FastAttributes
from nanoserve.model.rows import linear_rows

_FUSED_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


class RMSNorm(FastAttributes, nn.Module):
    """RMSNorm computed in float32 and cast back, as the reference implementation does.

    A decoder's norms also carry the residual stream (`add_norm`): the previous block's output is added to the
    stream and the sum normed, in one pass of fused.c when the layer was built with the fused kernels (the stream
    then float32, added to in place), else as torch's add and norm.
    """

    def __init__(self, dim: int, eps: float, kernels=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels  # FusedKernels (nanoserve/kernels/fused.py) or None: chosen at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32 and _FUSED_RMS_NORM:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, the same arithmetic
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, stream: torch.Tensor, delta: torch.Tensor | None,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(stream + delta), stream + delta); delta None: the stream as it is. On the fused kernels the
        normed rows come in `out_dtype` (the consumer's input dtype, written directly) and the stream is added to
        in place (a stream it does not own, the embedding's, is copied first); else they come in the stream's
        dtype and the stream is a new tensor (adding a bfloat16 projection's output promotes it exactly)."""
        if self.kernels is None:
            stream = stream if delta is None else stream + delta
            return self.forward(stream), stream
        if delta is None and (stream._base is not None or not stream.is_contiguous()):
            stream = stream.contiguous().clone()
        return self.kernels.add_norm(stream, self.weight, self.eps, delta, out_dtype), stream

    def add_norm_rows(self, stream: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """norm((stream + delta)[rows]), in the stream's dtype: the last norm, which only the sampled rows need."""
        if self.kernels is None:
            return self.forward((stream + delta)[rows])
        stream = self.kernels.add_(stream, delta.contiguous())
        return self.kernels.add_norm(stream[rows], self.weight, self.eps, None, stream.dtype)


class SiluAndMul(FastAttributes, nn.Module):
    """silu(gate) * up of a merged gate_up output, in its dtype: fused.c's one pass or torch's ops."""

    def __init__(self, kernels=None):
        super().__init__()
        self.kernels = kernels  # chosen at load

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MergedLinear(FastAttributes, nn.Module):
    """Several checkpoint projections stored as one weight, so a step runs one larger matmul.

    Each shard knows its row range; the loader calls `load_shard` with the checkpoint's name for it, and
    counts the projection loaded only when every shard in `offsets` (and each bias shard) has arrived.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False, row_multiple: int = 1):
        super().__init__()
        self.row_multiple = row_multiple  # rows of a call are padded to this (nanoserve/model/rows.py)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.offsets[name] = (start, start + rows)
            start += rows
        self.weight = nn.Parameter(torch.empty(start, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(start), requires_grad=False) if bias else None
        self.sizes = list(shards.values())

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        lo, hi = self.offsets[shard]
        target = getattr(self, kind)
        if target is None:
            raise ValueError(f"{shard}.{kind} given but this projection has no {kind}")
        if tensor.shape != target[lo:hi].shape:
            expected = tuple(target[lo:hi].shape)
            raise ValueError(f"{shard}.{kind} has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[lo:hi].copy_(tensor)

    @property
    def matmul_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype a caller should hand forward (the fused norm writes it directly)."""
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias, self.row_multiple)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with llama3 or linear scaling applied as the reference does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(FastAttributes, nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table indexed by position.

    `sin` is stored with the rotation's sign folded into its first half (-sin, +sin), so a rotation is one
    roll and one fused multiply-add (apply_rope) instead of slicing, negating and concatenating the halves.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, looked up once per forward and shared by every layer."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, dim] by the per-token cos and signed sin ([tokens, 1, dim], see RotaryEmbedding):
    x cos + (x2, x1) (-sin, sin), which is the reference's x cos + (-x2, x1) sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
