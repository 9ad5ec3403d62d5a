"""The quantized linear seam: 4-bit weights kept packed, and the kernel chosen by how many rows a call has.

A checkpoint's 4-bit blocks (GGUF Q4_0 / Q4_1, or a Hugging Face checkpoint quantized at load) become
`Int4Blocks`: codes 0..15 with a scale and a zero per group of 32 inputs, w = (q - 8) * scale + zero, which is
what torch's packed int4 CPU kernel computes. `Int4Linear` holds the packed weight and, where it measures faster,
a dense bfloat16 copy for calls with many rows (prefill chunks, wide decode batches): the packed kernel reads a
quarter of the bytes, which wins while a call is bound by memory, and loses to a dense matmul once the rows make
it bound by compute. Both kernels take bfloat16 activations (the packed one is vectorised for bfloat16 only);
everything around the linears, attention included, stays in the model's own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanoserve.model.attrs import FastAttributes
from nanoserve.timing import best_seconds

GROUP = 32  # inputs per scale/zero group: GGUF's Q4 block, and the packed kernel's group size
ROW_PROBES = (1, 2, 4, 8, 16, 32, 64, 128)  # call widths timed once per weight shape to find the crossover
ACT = torch.bfloat16


def int4_supported(device: torch.device) -> bool:
    """Whether this torch has the packed int4 kernel for `device` (the CPU one; CUDA keeps dense weights)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int8_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass(frozen=True)
class Int4Blocks:
    """A [out, in] weight as 4-bit codes plus a scale and zero per group of 32 inputs: w = (q - 8) * s + z."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # float32 [out, in // 32]
    zeros: torch.Tensor  # float32 [out, in // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these blocks stand for."""
        out, k = self.shape
        q = self.codes.view(out, k // GROUP, GROUP).float() - 8
        return (q * self.scales[..., None] + self.zeros[..., None]).view(out, k)

    def rows(self, order: np.ndarray) -> Int4Blocks:
        """The same blocks with output rows reordered (GGUF's q/k rows are permuted for its rope layout)."""
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int4Blocks(self.codes[index], self.scales[index], self.zeros[index])

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Stacked along the output rows: the merged qkv and gate_up projections."""
        return Int4Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]))

    @staticmethod
    def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
        """GGUF Q4_0 (w = d (q - 8)) or Q4_1 (w = d q + m) blocks, exactly: scale d, zero 0 or m + 8 d."""
        out, k = shape
        width = {"Q4_0": 18, "Q4_1": 20}[type_name]
        blocks = raw.reshape(-1, width)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        qs = blocks[:, width - 16:]
        codes = np.empty((blocks.shape[0], GROUP), dtype=np.uint8)
        codes[:, :16] = qs & 0x0F  # ggml: element j in the low nibble of byte j, element j + 16 in the high one
        codes[:, 16:] = qs >> 4
        if type_name == "Q4_1":
            zero = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] + 8 * d
        else:
            zero = np.zeros_like(d)
        groups = (out, k // GROUP)
        return Int4Blocks(torch.from_numpy(codes.reshape(out, k)), torch.from_numpy(d.reshape(groups)),
                          torch.from_numpy(zero.reshape(groups)))

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int4Blocks:
        """Min-max asymmetric 4-bit quantization per group of 32 (gpt-fast's and torchao's int4 weight-only)."""
        out, k = weight.shape
        w = weight.float().view(out, k // GROUP, GROUP)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return Int4Blocks(codes.view(out, k), scale, lo + 8 * scale)


class PackedLinear(FastAttributes, nn.Module):
    """y = x W^T (+ b) on a packed weight-only kernel; calls of at least `dense_from_rows` rows use a dense bf16
    copy instead (see dense_crossover). `calls` counts the calls each kernel actually served."""

    format = ""

    def __init__(self, out: int, k: int, bias: torch.Tensor | None, sizes: list[int] | None):
        super().__init__()
        self.in_features, self.out_features = k, out
        self.sizes = sizes or [out]  # a merged projection's split, as MergedLinear has it
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.dense: torch.Tensor | None = None
        self.dense_from_rows: int | None = None
        self.calls = {self.format: 0, "dense": 0}

    def use_dense_from(self, rows: int | None, weight: torch.Tensor) -> None:
        """Serve calls of `rows` rows and more from a bf16 copy of `weight` (None: the packed kernel always)."""
        self.dense_from_rows = rows
        self.dense = None if rows is None else weight.to(ACT).contiguous()

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x in any float dtype -> y in bfloat16 (float32 with a bias): the caller takes it as it is, since a
        residual add promotes it exactly and the MLP runs bfloat16 into the next packed call."""
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        flat = flat.to(ACT)
        if self.dense is not None and flat.shape[0] >= self.dense_from_rows:
            self.calls["dense"] += 1
            y = torch.nn.functional.linear(flat, self.dense)
        else:
            self.calls[self.format] += 1
            y = self.packed_mm(flat)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


class Int4Linear(PackedLinear):
    """4-bit codes in groups of 32 (Int4Blocks) on torch's packed int4 CPU kernel."""

    format = "int4"

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None, sizes: list[int] | None = None,
                 dense_from_rows: int | None = None):
        out, k = blocks.shape
        if k % GROUP:
            raise ValueError(f"int4 weights need inputs in groups of {GROUP}; this one has {k}")
        super().__init__(out, k, bias, sizes)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), 1))
        self.register_buffer("scales_and_zeros",
                             torch.stack([blocks.scales.t(), blocks.zeros.t()], -1).to(ACT).contiguous())
        if dense_from_rows is not None:
            self.use_dense_from(dense_from_rows, blocks.dequantize())

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)


class Int8Linear(PackedLinear):
    """A weight quantized to int8 per output row (symmetric) on torch's int8 weight-only CPU kernel: for dense
    checkpoints under --quantization int8, and for the output head over a GGUF file's Q8_0 embedding, whose
    32-wide blocks the kernel cannot take as they are (one scale a row is the nearest it computes)."""

    format = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, sizes: list[int] | None = None):
        out, k = weight.shape
        super().__init__(out, k, bias, sizes)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("weight_int8", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(ACT))

    def dequantize(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)


_CROSSOVERS: dict[tuple, int | None] = {}  # (format, out, in, threads) -> rows, measured once a process


DENSE_MARGIN = 0.85  # the dense copy must take at most this share of the packed kernel's time to be chosen


def dense_crossover(linear: PackedLinear, weight: torch.Tensor, repeats: int = 5) -> int | None:
    """The fewest rows from which a dense bf16 matmul beats the packed kernel on this machine, timed once per
    format, weight shape and process (about a millisecond per probe); None when the packed kernel always wins.

    A width counts only when the dense copy wins there and at the next width too, by DENSE_MARGIN, each time
    the best of `repeats`: a probe that a busy neighbour slowed must not send every call to the dense copy.
    Kept for the process: which kernel serves a call changes its last bits, so two engines in one process (an
    A/B run, a restart) must choose alike or a switch under test would seem to change the output.
    """
    key = (linear.format, linear.out_features, linear.in_features, torch.get_num_threads())
    if key not in _CROSSOVERS:
        dense = weight.to(ACT)

        def dense_wins(rows: int) -> bool:
            x = torch.randn(rows, linear.in_features, dtype=ACT)
            packed = best_seconds(lambda: linear.packed_mm(x), repeats)
            return best_seconds(lambda: torch.nn.functional.linear(x, dense), repeats) < DENSE_MARGIN * packed

        wins = [dense_wins(rows) for rows in ROW_PROBES]
        _CROSSOVERS[key] = next((rows for rows, here, after in zip(ROW_PROBES, wins, [*wins[1:], True])
                                 if here and after), None)
    return _CROSSOVERS[key]


class BF16Linear(FastAttributes, nn.Module):
    """A dense linear run on a bfloat16 copy of its weight (the output head over a tied, unquantized embedding),
    where it measured fastest for one row (see fastest_head)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight_bf16", weight.detach().to(ACT).contiguous())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(ACT), self.weight_bf16).to(x.dtype)


HEADS = {"bfloat16": BF16Linear, "int8": Int8Linear}
_HEADS: dict[tuple, dict[str, float]] = {}  # (shape, dtype, threads) -> seconds a row per head, once a process


def fastest_head(weight: torch.Tensor, repeats: int = 3) -> str:
    """Which runs one row through `weight` fastest here: its own dtype ("own"), a bf16 copy, or int8 per row."""
    times = head_timings(weight, repeats)
    return min(times, key=times.get)


def head_timings(weight: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """Seconds for one row through `weight` in each form the head can take, measured once a process."""
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
    if key not in _HEADS:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
        times = {"own": best_seconds(lambda: torch.nn.functional.linear(x, weight), repeats)}
        if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            candidates = HEADS
        else:
            candidates = {"bfloat16": BF16Linear}
        for name, cls in candidates.items():
            head = cls(weight)
            times[name] = best_seconds(lambda head=head: head(x), repeats)
        _HEADS[key] = times
    return _HEADS[key]


@dataclass
class QuantStats:
    """What the quantized seam holds and did: published as the `linear` section of the stats snapshot."""

    formats: dict[str, int]  # format -> projections packed in it
    packed_bytes: int
    dense_bytes: int  # the bf16 copies kept for wide calls, and the head's copy
    dense_from_rows: dict[str, int | None]  # "format out x in" -> rows from which the dense copy serves
    calls: dict[str, int]  # calls each kernel served, counted by the modules as they dispatch
    head: str  # what the output head runs: int8 or bfloat16 where that measured fastest, else the model's dtype
    head_us: dict[str, float]  # the measurement behind `head`: microseconds a row in each form ("own" = as loaded)

    def as_dict(self) -> dict:
        kinds = sorted(self.formats)
        return {"format": kinds[0] if len(kinds) == 1 else "+".join(kinds), "group": GROUP,
                "modules": sum(self.formats.values()), **{f"{k}_modules": n for k, n in self.formats.items()},
                "packed_bytes": self.packed_bytes, "dense_bytes": self.dense_bytes,
                "dense_from_rows": dict(self.dense_from_rows),
                **{f"{k}_calls": n for k, n in self.calls.items()}, "head": self.head,
                "head_us": dict(self.head_us)}


def install_quantized(model: nn.Module, kept: dict[str, dict[str, Int4Blocks]], mode: str) -> QuantStats | None:
    """Swap the decoder's linears for packed ones: each whose weights arrived as 4-bit blocks (`kept`: module
    path -> shard -> blocks) becomes an Int4Linear; under mode "int4" or "int8" every other decoder linear is
    quantized at load to that format. A merged projection with some shards dense and some 4-bit (a mixed file)
    stays dense: its 4-bit shards are written dequantized. Returns None when nothing was swapped."""
    from nanoserve.model.layers import MergedLinear

    calls = {"int4": 0, "int8": 0, "dense": 0}
    formats: dict[str, int] = {}
    crossover: dict[str, int | None] = {}
    packed = dense = 0
    targets = [(p, m) for p, m in model.named_modules()
               if isinstance(m, MergedLinear | nn.Linear) and p.startswith("layers.")]
    for path, module in targets:
        shards = kept.get(path, {})
        names = list(module.offsets) if isinstance(module, MergedLinear) else ["weight"]
        if shards and set(shards) != set(names):
            for shard, blocks in shards.items():  # a mixed merged projection: dense it is
                module.load_shard(shard, "weight", blocks.dequantize().to(module.weight.dtype))
            continue
        bias, sizes = (module.bias.data if module.bias is not None else None), getattr(module, "sizes", None)
        if shards or mode == "int4":
            blocks = Int4Blocks.cat([shards[n] for n in names]) if shards else Int4Blocks.quantize(module.weight.data)
            linear, weight = Int4Linear(blocks, bias, sizes), blocks.dequantize()
        elif mode == "int8":
            linear = Int8Linear(module.weight.data, bias, sizes)
            weight = linear.dequantize()
        else:
            continue
        rows = dense_crossover(linear, weight)
        linear.use_dense_from(rows, weight)
        crossover[f"{linear.format} {linear.out_features}x{linear.in_features}"] = rows
        linear.calls = calls  # one tally for every module: the snapshot reads it without walking the model
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, linear)
        formats[linear.format] = formats.get(linear.format, 0) + 1
        packed += sum(b.numel() * b.element_size() for b in linear.buffers())
        dense += linear.dense.numel() * 2 if linear.dense is not None else 0
    if not formats:
        return None
    head_us = {name: round(t * 1e6, 1) for name, t in head_timings(model.lm_head.weight).items()}
    head = fastest_head(model.lm_head.weight)
    if head == "own":
        head = str(model.lm_head.weight.dtype).removeprefix("torch.")
    else:
        model.lm_head = HEADS[head](model.lm_head.weight)
        dense += sum(b.numel() * b.element_size() for b in model.lm_head.buffers())
    return QuantStats(formats, packed, dense, crossover, calls, head, head_us)
