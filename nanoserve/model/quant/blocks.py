"""A checkpoint's quantized blocks as torch tensors, exactly as the file defines them.

`Int4Blocks`: codes 0..15 with a scale and a zero per group of 32 inputs, w = (q - 8) * scale + zero, which is
what torch's packed int4 CPU kernel computes (GGUF Q4_0 / Q4_1, or a dense weight quantized at load).
`Int8Blocks`: codes -128..127 with a scale per group of 32 inputs, w = q * scale (GGUF Q8_0).
`KQuantBlocks`: GGUF's K-quant super-blocks of 256 inputs (Q4_K, Q5_K, Q6_K) and the rarer types' blocks (Q5_0,
Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K), the file's bytes as they lie.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs per scale group: GGUF's Q4 and Q8 block, and the packed kernel's group size
Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # GGUF's 4-bit blocks of 32: f16 d (and Q4_1's f16 m), 16 bytes of nibbles


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


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
        width = Q4_BLOCK_BYTES[type_name]
        blocks = raw.reshape(-1, width)
        d = _f16(blocks, 0)
        qs = blocks[:, width - 16:]
        codes = np.empty((blocks.shape[0], GROUP), dtype=np.uint8)
        codes[:, :16] = qs & 0x0F  # ggml: element j in the low nibble of byte j, element j + 16 in the high one
        codes[:, 16:] = qs >> 4
        zero = _f16(blocks, 2) + 8 * d if type_name == "Q4_1" else np.zeros_like(d)
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


@dataclass(frozen=True)
class GgufInt4Rows:
    """A [out, in] weight as a GGUF file's Q4_0 / Q4_1 rows, the file's bytes as they lie (blocks of 32: an f16
    d, Q4_1's f16 m, 16 bytes of nibbles). The fused 4-bit kernels pack their weight straight from these bytes (no
    unpacked copy of the codes at load); everything else takes them as the Int4Blocks they stand for (`int4`). A
    merged projection's shards stay separate runs of rows (`parts`, stacked along the outputs): q4x8 packs each in
    place, where a copy of them all cost a 3B file's load half a second."""

    type_name: str  # "Q4_0" or "Q4_1"
    parts: tuple[torch.Tensor, ...]  # uint8 [rows, in / 32 * block bytes] each
    in_features: int

    @property
    def raw(self) -> torch.Tensor:
        """Every row's bytes in one tensor (a copy where there are several parts)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.in_features

    def int4(self) -> Int4Blocks:
        return Int4Blocks.from_gguf(self.raw.contiguous().numpy().reshape(-1), self.type_name, self.shape)

    def dequantize(self) -> torch.Tensor:
        return self.int4().dequantize()

    def rows(self, order: np.ndarray) -> GgufInt4Rows:
        return GgufInt4Rows(self.type_name, (self.raw[torch.from_numpy(np.ascontiguousarray(order))],),
                            self.in_features)

    def slice(self, dim: int, start: int, stop: int) -> GgufInt4Rows | None:
        """A copy of output rows [start, stop) (dim 0) or input columns [start, stop) (dim 1); None when the columns
        are not whole blocks of 32."""
        if dim == 0:
            return GgufInt4Rows(self.type_name, (self.raw[start:stop].clone(),), self.in_features)
        if start % GROUP or stop % GROUP:
            return None
        width = Q4_BLOCK_BYTES[self.type_name]
        part = self.raw[:, start // GROUP * width:stop // GROUP * width].contiguous()
        return GgufInt4Rows(self.type_name, (part,), stop - start)

    @staticmethod
    def cat(parts: list[GgufInt4Rows]) -> GgufInt4Rows | Int4Blocks:
        """Stacked along the output rows (no copy): the file's rows where they share a type, else their
        Int4Blocks."""
        if len({p.type_name for p in parts}) > 1:
            return Int4Blocks.cat([p.int4() for p in parts])
        return GgufInt4Rows(parts[0].type_name, tuple(t for p in parts for t in p.parts), parts[0].in_features)

    @staticmethod
    def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GgufInt4Rows:
        out, k = shape
        return GgufInt4Rows(type_name, (torch.from_numpy(raw.reshape(out, -1)),), k)


def as_int4(blocks: Int4Blocks | GgufInt4Rows) -> Int4Blocks:
    """The codes, scales and zeros of 4-bit blocks in either form."""
    return blocks.int4() if isinstance(blocks, GgufInt4Rows) else blocks


@dataclass(frozen=True)
class Int8Blocks:
    """A [out, in] weight as 8-bit codes plus a scale per group of 32 inputs: w = q * s (GGUF Q8_0).

    torch has no int8 kernel with a scale per group, and one scale per row (its int8 kernel) would add several
    times the file's own rounding error. Split each code as q = 16 hi + lo (hi in -8..7, lo in 0..15) and the
    weight is two 4-bit planes the int4 kernel computes exactly: (hi + 8 - 8) * 16 s + 0 and (lo - 8) * s + 8 s.
    """

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        out, k = self.shape
        return (self.codes.view(out, k // GROUP, GROUP).float() * self.scales[..., None]).view(out, k)

    def rows(self, order: np.ndarray) -> Int8Blocks:
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Int8Blocks(self.codes[index], self.scales[index])

    @staticmethod
    def cat(parts: list[Int8Blocks]) -> Int8Blocks:
        return Int8Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    def planes(self) -> tuple[Int4Blocks, Int4Blocks]:
        """The high and low 4-bit planes whose weights add up to this one's, exactly."""
        q = self.codes.to(torch.int16)
        hi = torch.div(q, 16, rounding_mode="floor")
        lo = q - 16 * hi
        s = self.scales
        return (Int4Blocks((hi + 8).to(torch.uint8), 16 * s, torch.zeros_like(s)),
                Int4Blocks(lo.to(torch.uint8), s.clone(), 8 * s))

    @staticmethod
    def from_gguf(raw: np.ndarray, shape: tuple[int, int]) -> Int8Blocks:
        """GGUF Q8_0 blocks (an f16 scale d, then 32 int8 codes: w = d q), exactly."""
        out, k = shape
        blocks = raw.reshape(-1, 34)
        d = _f16(blocks, 0)
        codes = blocks[:, 2:].copy().view(np.int8)
        return Int8Blocks(torch.from_numpy(codes.reshape(out, k)), torch.from_numpy(d.reshape(out, k // GROUP)))


SUPER_BLOCK = 256  # inputs per K-quant super-block
HALF_UNIT = 32  # inputs per unit of a 16-bit row (kernels/kquant.c's float lanes)
# the GGUF types whose rows kernels/kquant.c's type table reads as the file lays them out, (inputs per unit,
# bytes per unit): the K-quants, IQ4_XS, Q5_0, Q5_1, IQ4_NL (eight blocks of 32 a unit), and 16-bit rows
K_QUANT_UNITS = {"Q4_K": (SUPER_BLOCK, 144), "Q5_K": (SUPER_BLOCK, 176), "Q6_K": (SUPER_BLOCK, 210),
                 "Q5_0": (SUPER_BLOCK, 8 * 22), "Q5_1": (SUPER_BLOCK, 8 * 24), "IQ4_NL": (SUPER_BLOCK, 8 * 18),
                 "IQ4_XS": (SUPER_BLOCK, 136), "Q2_K": (SUPER_BLOCK, 84), "Q3_K": (SUPER_BLOCK, 110),
                 "F16": (HALF_UNIT, 2 * HALF_UNIT), "BF16": (HALF_UNIT, 2 * HALF_UNIT)}
HALF_TYPES = ("F16", "BF16")  # kept as stored only where a tensor is a matrix (a norm's vector stays dense)


@dataclass(frozen=True)
class KQuantBlocks:
    """A [out, in] weight as GGUF K-quant super-blocks, each output row the file's bytes as they lie (no
    repacking: the kernel reads the file's layout). A merged projection's shards may come in different types
    (a Q4_K_M file stores q and k as Q4_K and v, in half the layers, as Q6_K): each run of rows keeps its own.
    Stacked tensors stay apart (no copy at load); the kernel's module packs adjacent ones of a type together."""

    segments: tuple[tuple[str, torch.Tensor], ...]  # (type name, uint8 [rows, in / 256 * block bytes]), in order
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return sum(raw.shape[0] for _, raw in self.segments), self.in_features

    @property
    def type_names(self) -> tuple[str, ...]:
        """The types of its runs of rows, in order (adjacent tensors of one type named once)."""
        return tuple(name for name, _ in itertools.groupby(name for name, _ in self.segments))

    @property
    def unit(self) -> int:
        """The inputs a row must come in whole runs of, for every segment's type (256, or 32 for 16-bit rows)."""
        return max(K_QUANT_UNITS[name][0] for name in self.type_names)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these blocks stand for, bit for bit gguf's reference dequantization."""
        from gguf import GGMLQuantizationType  # only where blocks came from a file

        from nanoserve.model.gguf.dequant import dequantize

        return torch.cat([torch.from_numpy(dequantize(raw.numpy().reshape(-1), GGMLQuantizationType[name],
                                                      (raw.shape[0], self.in_features))) for name, raw in self.segments])

    def rows(self, order: np.ndarray) -> KQuantBlocks:
        """The same blocks with output rows reordered (one tensor's: GGUF's q/k rope layout)."""
        (name, raw), = self.segments
        return KQuantBlocks(((name, raw[torch.from_numpy(np.ascontiguousarray(order))]),), self.in_features)

    def slice(self, dim: int, start: int, stop: int) -> KQuantBlocks | None:
        """A copy of output rows [start, stop) (dim 0) or input columns [start, stop) (dim 1) of one tensor's
        blocks; None when the columns are not whole units of the type."""
        (name, raw), = self.segments
        if dim == 0:
            return KQuantBlocks(((name, raw[start:stop].clone()),), self.in_features)
        inputs, width = K_QUANT_UNITS[name]
        if start % inputs or stop % inputs:
            return None
        part = raw[:, start // inputs * width:stop // inputs * width].contiguous()
        return KQuantBlocks(((name, part),), stop - start)

    @staticmethod
    def cat(parts: list[KQuantBlocks]) -> KQuantBlocks:
        """Stacked along the output rows, each tensor's rows where they lie (merging a run's copies nothing until
        its kernel packs it: a 3B model's merged projections spent 0.25 s of its load in torch.cat)."""
        return KQuantBlocks(tuple(seg for part in parts for seg in part.segments), parts[0].in_features)

    @staticmethod
    def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> KQuantBlocks:
        out, k = shape
        return KQuantBlocks(((type_name, torch.from_numpy(raw.reshape(out, -1))),), k)


QuantBlocks = Int4Blocks | GgufInt4Rows | Int8Blocks | KQuantBlocks


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantBlocks:
    """The blocks of a GGUF tensor of a type kept as it is (KEPT_GGUF_TYPES)."""
    if type_name in K_QUANT_UNITS:
        return KQuantBlocks.from_gguf(raw, type_name, shape)
    if type_name == "Q8_0":
        return Int8Blocks.from_gguf(raw, shape)
    return GgufInt4Rows.from_gguf(raw, type_name, shape)


# computed by the packed kernels exactly as the file defines them (the K-quants where the fused library runs;
# elsewhere their projections are dequantized one at a time as they are installed)
KEPT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", *K_QUANT_UNITS)
