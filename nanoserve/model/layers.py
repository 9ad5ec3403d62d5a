"""The decoder's building blocks: norm, activation and rotary embedding (the projections are in linear.py).

A layer that has a fused CPU kernel is given the kernels (or None) when it is built, at load: which code runs is
decided then, once, from the machine and the model's dtype, and a model's forward is one path."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.attrs import FastAttributes

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
        # index_select, not stream[rows]: torch's indexing wakes its OpenMP threads even for one row, whose spin
        # afterwards took a core from the kernels' pool for a few ms of every decode token
        return self.kernels.add_norm(stream.index_select(0, rows), self.weight, self.eps, None, stream.dtype)


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


class GeluAndMul(FastAttributes, nn.Module):
    """gelu(gate) * up of a merged gate_up output: the exact erf GELU, or its tanh approximation (transformers'
    gelu_pytorch_tanh and gelu_new compute the same function). No fused kernel: torch's ops on every machine."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# hidden_act (transformers' names) -> the gated activation layer that computes it, chosen once at load
ACTIVATIONS = {"silu": lambda kernels: SiluAndMul(kernels), "swish": lambda kernels: SiluAndMul(kernels),
               "gelu": lambda kernels: GeluAndMul("none"),
               "gelu_pytorch_tanh": lambda kernels: GeluAndMul("tanh"),
               "gelu_new": lambda kernels: GeluAndMul("tanh")}


def act_and_mul(hidden_act: str, kernels=None) -> nn.Module:
    """The MLP's gated activation for `hidden_act` (ModelConfig.check refuses the ones not in ACTIVATIONS)."""
    return ACTIVATIONS[hidden_act](kernels)


def rope_kind(scaling: dict | None) -> str:
    return "default" if not scaling else (scaling.get("rope_type") or scaling.get("type") or "default")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with llama3, linear or yarn scaling applied as the reference does (longrope has two
    sets: rope_long_short)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_kind(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by factor), extrapolated (kept), or ramped between the two by
    how many turns it makes over the original context (beta_fast / beta_slow)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (1 for the others)."""
    kind = rope_kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_angles(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[positions, head_dim / 2] rotation angles. LongRoPE rotates positions within the original context by its
    short factors and those past it by its long ones (vLLM's per-position rule: a position's angle never depends
    on how long its sequence is)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if rope_kind(scaling) != "longrope":
        return torch.outer(positions, rope_inv_freq(head_dim, theta, scaling))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** shape)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** shape)
    within = (positions < float(scaling["original_max_position_embeddings"]))[:, None]
    return torch.where(within, torch.outer(positions, short), torch.outer(positions, long))


class RotaryEmbedding(FastAttributes, nn.Module):
    """Neox-style rotary embedding over a precomputed cos/sin table indexed by position.

    `sin` is stored with the rotation's sign folded into its first half (-sin, +sin), so a rotation is one
    roll and one fused multiply-add (apply_rope) instead of slicing, negating and concatenating the halves.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.shape = (head_dim, max_positions, theta, scaling)
        if torch.get_default_device().type == "meta":  # placeholders until materialize: torch's meta arange
            cos = sin = torch.empty(max_positions, head_dim)  # would import its compiler stack (a second a load)
        else:
            cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_positions, theta, scaling = self.shape
        freqs = rope_angles(head_dim, max_positions, theta, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rope_attention_factor(scaling)
        sin = emb.sin() * scale
        sin[:, : head_dim // 2].neg_()
        return emb.cos() * scale, sin

    def materialize(self, device: torch.device) -> None:
        """Compute the tables for real, in float32, on `device`: a model is built on the meta device and its
        tensors made empty there (and cast to the model's dtype); the rotary table is computed, not loaded."""
        with torch.device("cpu"):
            cos, sin = self._tables()
        self.cos, self.sin = cos.to(device), sin.to(device)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, looked up once per forward and shared by every layer."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, dim] by the per-token cos and signed sin ([tokens, 1, dim], see RotaryEmbedding):
    x cos + (x2, x1) (-sin, sin), which is the reference's x cos + (-x2, x1) sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
