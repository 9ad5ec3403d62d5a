"""The packed linears: y = x W^T on torch's weight-only CPU kernels, with a dense bfloat16 copy for wide calls.

The packed kernels read a quarter (int4) or half (int8) of the bytes a bfloat16 weight takes, which wins while a
call is bound by memory (one decode row, a few); once the rows make it bound by compute a dense matmul wins, so
each linear serves calls of at least `dense_from_rows` rows from a dense copy (see install.dense_crossover).
Both kernels take bfloat16 activations (they are vectorised for bfloat16 only).
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.model.attrs import FastAttributes
from nanoserve.model.quant.blocks import (
    GROUP,
    GgufInt4Rows,
    Int4Blocks,
    Int8Blocks,
    KQuantBlocks,
    as_int4,
)
from nanoserve.model.rows import linear_rows

ACT = torch.bfloat16


def int4_supported(device: torch.device) -> bool:
    """Whether this torch has the packed int4 kernel for `device` (the CPU one; CUDA keeps dense weights)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int8_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int4_packable(out: int, k: int) -> bool:
    """The int4 kernel's shape rules: inputs in whole groups of 32, outputs a multiple of 16 (its packing)."""
    return k % GROUP == 0 and out % 16 == 0


def _pack_int4(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's packed weight (its layout depends on the machine: pack where it runs) and its
    [in // 32, out, 2] bfloat16 scales and zeros."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32).contiguous(), 1)
    return packed, torch.stack([blocks.scales.t(), blocks.zeros.t()], -1).to(ACT).contiguous()


class PackedLinear(FastAttributes, nn.Module):
    """y = x W^T (+ b) on a packed weight-only kernel; calls of at least `dense_from_rows` rows use a dense bf16
    copy instead (see dense_crossover). `calls` counts the calls each kernel actually served, `rows` the rows
    (tokens) of those calls: which rows went to which kernel."""

    format = ""
    input_dtype = ACT  # what forward casts its input to: a caller (the fused norm) may hand it over already cast
    read_chain = None  # ReadAheadChain (read_ahead.py) where --read-ahead names the next weight to the kernels
    read_span = read_next = None  # (address, bytes) of this linear's first weight bytes, of its successor's
    activation_form = "bfloat16"  # what the kernel multiplies the weights by (the snapshot's numerics say it)

    def __init__(self, out: int, k: int, bias: torch.Tensor | None, sizes: list[int] | None):
        super().__init__()
        self.in_features, self.out_features = k, out
        self.sizes = sizes or [out]  # a merged projection's split, as MergedColumnLinear has it
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self.dense: torch.Tensor | None = None
        self.dense_from_rows: int | None = None
        self.calls = {self.format: 0, "dense": 0}
        self.rows = {self.format: 0, "dense": 0}

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
        flat = flat.to(self.input_dtype)
        if self.dense is not None and flat.shape[0] >= self.dense_from_rows:
            self.calls["dense"] += 1
            self.rows["dense"] += flat.shape[0]
            y = torch.nn.functional.linear(flat.to(ACT), self.dense).to(self.input_dtype)
        else:
            self.calls[self.format] += 1
            self.rows[self.format] += flat.shape[0]
            if self.read_chain is not None:
                self.read_chain.before(self, flat.shape[0])
            y = self.packed_mm(flat)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


class Int4Linear(PackedLinear):
    """4-bit codes in groups of 32 (Int4Blocks) on torch's packed int4 CPU kernel."""

    format = "int4"

    def __init__(self, blocks: Int4Blocks | GgufInt4Rows, bias: torch.Tensor | None, sizes: list[int] | None = None,
                 dense_from_rows: int | None = None):
        blocks = as_int4(blocks)
        out, k = blocks.shape
        if not int4_packable(out, k):
            raise ValueError(f"int4 weights need inputs in groups of {GROUP} and outputs in 16s; this is {out}x{k}")
        super().__init__(out, k, bias, sizes)
        packed, scales_and_zeros = _pack_int4(blocks)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        if dense_from_rows is not None:
            self.use_dense_from(dense_from_rows, blocks.dequantize())

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)


class KernelLinear(PackedLinear):
    """A packed linear on one of the fused library's kernels (float32 in and out): forward's usual call, 2-D
    contiguous float32 rows with no dense copy in use, goes straight to the C function, about 4 us a call less
    than the general path (a decode step makes 121 of them)."""

    input_dtype = torch.float32
    activation_form = "int16 per 32"
    matmul = None  # the library's C entry (FusedKernels.q4_call / q8_call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_contiguous() or self.dense is not None:
            return super().forward(x)
        rows = x.shape[0]
        self.calls[self.format] += 1
        self.rows[self.format] += rows
        y = torch.empty(rows, self.out_features)
        if self.read_chain is not None:
            self.read_chain.before(self, rows)
        if rows and self.matmul(self.packed.data_ptr(), x.data_ptr(), rows, self.in_features, self.out_features,
                                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                torch.get_num_threads(), 0):
            raise MemoryError(f"the {self.format} kernel could not allocate the int8 copy of {rows} x "
                              f"{self.in_features} activations")
        return y


def row_quantum(model: nn.Module) -> int:
    """Rows `model`'s 4- and 8-bit linears compute as one unit in a wide call: a tile's height where they run on
    the fused library's tile unit (a step's cost steps up a tile at a time), else 1."""
    kernels = next((m.kernels for m in model.modules() if isinstance(m, KernelLinear)), None)
    return 1 if kernels is None else kernels.row_quantum


class Q4Linear(KernelLinear):
    """4-bit codes in groups of 32 (Int4Blocks) on the fused library's 4-bit x 16-bit kernel (kernels/linear.c):
    float32 in, each row's groups of 32 quantized to 16-bit codes inside the call, float32 out. An output depends on its
    row alone, whatever the call's rows, threads or vector width."""

    format = "q4x16"

    def __init__(self, blocks: Int4Blocks | GgufInt4Rows, bias: torch.Tensor | None, sizes: list[int] | None,
                 kernels):
        out, k = blocks.shape
        if not int4_packable(out, k):
            raise ValueError(f"int4 weights need inputs in groups of {GROUP} and outputs in 16s; this is {out}x{k}")
        super().__init__(out, k, bias, sizes)
        self.kernels, self.matmul = kernels, kernels.q4_call
        if isinstance(blocks, GgufInt4Rows):  # straight from the file's bytes, no unpacked codes
            self.register_buffer("packed", kernels.q4_pack_gguf(blocks.raw, blocks.type_name, k))
        else:
            self.register_buffer("packed", kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros))

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4_matmul(self.packed, flat.float().contiguous(), self.out_features)


class Q4x8Linear(KernelLinear):
    """A GGUF file's Q4_0 rows on the fused library's q4x8 kernel (kernels/q4x8.c): the 4-bit kernel's layout of
    codes with the file's scales and no zeros (4.5 bits a weight, as the file), each row's groups of 32 quantized to
    8-bit codes inside the call (the format llama.cpp multiplies Q4_0 by; half the integer work of q4x16's 16-bit
    codes). Q4_1 (the default model's) keeps q4x16. An output depends on its row alone, whatever the call's rows,
    threads or vector width."""

    format = "q4x8"
    activation_form = "int8 per 32"

    def __init__(self, blocks: GgufInt4Rows, bias: torch.Tensor | None, sizes: list[int] | None, kernels):
        out, k = blocks.shape
        if blocks.type_name != "Q4_0" or not int4_packable(out, k):
            raise ValueError(f"q4x8 takes Q4_0 rows with inputs in groups of {GROUP} and outputs in 16s; this is "
                             f"{blocks.type_name} {out}x{k}")
        super().__init__(out, k, bias, sizes)
        self.kernels, self.matmul = kernels, kernels.q4x8_call
        self.register_buffer("packed", kernels.q4x8_pack_gguf(blocks.parts, k))

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4x8_matmul(self.packed, flat.float().contiguous(), self.out_features)


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


class Q8Linear(KernelLinear):
    """8-bit codes with a scale per group of 32 (Int8Blocks, GGUF Q8_0) as they are, on the fused library's 8-bit x
    16-bit kernel (kernels/linear.c): one read of the file's bytes, each row's groups of 32 quantized to 16-bit codes
    inside the call, an output depending on its row alone. Where the machine has no vector path for it
    (FusedKernels.q8_vectorized), Int8GroupLinear's two 4-bit planes run instead."""

    format = "q8x16"

    def __init__(self, blocks: Int8Blocks, bias: torch.Tensor | None, sizes: list[int] | None, kernels):
        out, k = blocks.shape
        if not int4_packable(out, k):
            raise ValueError(f"8-bit group weights need inputs in groups of {GROUP} and outputs in 16s; this is "
                             f"{out}x{k}")
        super().__init__(out, k, bias, sizes)
        self.kernels, self.matmul = kernels, kernels.q8_call
        self.register_buffer("packed", kernels.q8_pack(blocks.codes, blocks.scales))

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_matmul(self.packed, flat.float().contiguous(), self.out_features)


class Int8GroupLinear(PackedLinear):
    """8-bit codes with a scale per group of 32 (Int8Blocks, GGUF Q8_0) as two 4-bit planes on the int4 kernel:
    the file's weights exactly (up to the scales' bfloat16), in the bytes an int8 weight takes."""

    format = "int8g32"

    def __init__(self, blocks: Int8Blocks, bias: torch.Tensor | None = None, sizes: list[int] | None = None,
                 kernels=None):
        out, k = blocks.shape
        if not int4_packable(out, k):
            raise ValueError(f"8-bit group weights need inputs in groups of {GROUP} and outputs in 16s; this is "
                             f"{out}x{k}")
        super().__init__(out, k, bias, sizes)
        hi, lo = blocks.planes()
        self.kernels = kernels  # FusedKernels: the planes run on its 4-bit x 16-bit kernel (float32 in and out)
        if kernels is not None:
            self.input_dtype, self.activation_form = torch.float32, "int16 per 32"
            self.register_buffer("packed_hi", kernels.q4_pack(hi.codes, hi.scales, hi.zeros))
            self.register_buffer("packed_lo", kernels.q4_pack(lo.codes, lo.scales, lo.zeros))
            return
        for name, plane in (("hi", hi), ("lo", lo)):
            packed, scales_and_zeros = _pack_int4(plane)
            self.register_buffer(f"packed_{name}", packed)
            self.register_buffer(f"scales_and_zeros_{name}", scales_and_zeros)

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            x = flat.float().contiguous()
            y = self.kernels.q4_matmul(self.packed_hi, x, self.out_features)
            return self.kernels.q4_matmul(self.packed_lo, x, self.out_features, add_to=y)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return (mm(flat, self.packed_hi, GROUP, self.scales_and_zeros_hi)
                + mm(flat, self.packed_lo, GROUP, self.scales_and_zeros_lo))


class KQuantLinear(PackedLinear):
    """GGUF K-quant rows (KQuantBlocks: Q4_K, Q5_K, Q6_K) on the fused library's K-quant kernels (kernels/kquant.c):
    float32 in, each row's super-blocks of 256 quantized to 8-bit codes inside the call (the activation format
    llama.cpp multiplies these blocks by), float32 out; the rarer types (Q2_K, Q3_K, IQ4_XS, and Q5_0, Q5_1,
    IQ4_NL in blocks of 32) alike, and a 16-bit file's F16 / BF16 rows against the float32 activations as they
    are. Rows run as the file holds them, except Q4_K, Q5_K and Q6_K in runs of 16 outputs: those are interleaved 16
    outputs a super-block at load (kernels/kx16.c; `interleave=False` keeps the file's rows, for comparing the
    two). Which kernel a run takes is fixed at load by its type and shape. A merged
    projection's runs of rows of different types each fill their columns of the one output. An output depends on
    its row alone."""

    format = "kquant"
    input_dtype = torch.float32
    activation_form = "int8 per 256"

    def __init__(self, blocks: KQuantBlocks, bias: torch.Tensor | None, sizes: list[int] | None, kernels,
                 interleave: bool = True):
        out, k = blocks.shape
        if k % blocks.unit:
            raise ValueError(f"{'/'.join(blocks.type_names)} weights take inputs in runs of {blocks.unit}; "
                             f"this is {out}x{k}")
        super().__init__(out, k, bias, sizes)
        self.kernels, self.type_names = kernels, blocks.type_names
        self.segments = []  # ("kx16" interleaved or "kq" the file's rows, the library's type index, first, outputs)
        first = 0
        for name, parts, interleaved in self._runs(blocks, interleave):
            outs, i = sum(raw.shape[0] for raw in parts), len(self.segments)
            if interleaved:
                self.register_buffer(f"raw{i}", kernels.kx16_pack(name, parts, k))  # each part packed in place
                self.segments.append(("kx16", kernels.kx16_types[name], first, outs))
            else:
                self.register_buffer(f"raw{i}", parts[0].contiguous())
                self.segments.append(("kq", kernels.kq_types[name], first, outs))
            first += outs

    def _runs(self, blocks: KQuantBlocks, interleave: bool) -> list[tuple[str, list[torch.Tensor], bool]]:
        """The blocks' tensors as the kernel calls take them: adjacent ones of one type the interleaving takes
        (in 16s) as one run, packed together; any other alone, as the file's rows."""
        runs: list[tuple[str, list[torch.Tensor], bool]] = []
        for name, raw in blocks.segments:
            interleaved = interleave and name in self.kernels.kx16_types and raw.shape[0] % 16 == 0
            if interleaved and runs and runs[-1][0] == name and runs[-1][2]:
                runs[-1][1].append(raw)
            else:
                runs.append((name, [raw], interleaved))
        return runs

    def packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        x = flat.float().contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features)
        for i, (entry, kind, first, outs) in enumerate(self.segments):
            call = self.kernels.kx16_call if entry == "kx16" else self.kernels.kq_call
            if rows and call(kind, getattr(self, f"raw{i}").data_ptr(), x.data_ptr(), rows, self.in_features, outs,
                             self.out_features, None, y.data_ptr() + 4 * first, torch.get_num_threads(), 0):
                raise MemoryError(f"the K-quant kernel could not allocate the int8 copy of {rows} x "
                                  f"{self.in_features} activations")
        return y

    def file_rows(self, i: int) -> tuple[str, torch.Tensor]:
        """Segment i as the file held it: (type name, its rows' bytes)."""
        entry, kind, _, outs = self.segments[i]
        interleaved = entry == "kx16"
        names = {index: name for name, index in (self.kernels.kx16_types if interleaved else self.kernels.kq_types).items()}
        raw = getattr(self, f"raw{i}")
        return names[kind], self.kernels.kx16_unpack(names[kind], raw, outs, self.in_features) if interleaved else raw

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, row for row as gguf dequantizes the file's blocks (the kernels' own decoder)."""
        every = torch.arange(self.out_features)
        parts = []
        for i, (_, _, _, outs) in enumerate(self.segments):
            name, raw = self.file_rows(i)
            parts.append(self.kernels.kq_dequant_rows(name, raw, self.in_features, every[:outs]))
        return torch.cat(parts)


class KQuantRows(nn.Module):
    """An embedding's rows looked up in K-quant blocks, each dequantized as gguf does when asked: the table is held
    in the file's bytes, or in the interleaved table of the head it is tied to (`of_head`: one table, multiplied
    by the head at its fastest), never as a float32 copy."""

    def __init__(self, blocks: KQuantBlocks, kernels):
        super().__init__()
        (type_name, raw), = blocks.segments
        self._hold(type_name, raw.contiguous(), raw.shape[0], blocks.shape[1], kernels, interleaved=False)

    def _hold(self, type_name: str, raw: torch.Tensor, rows: int, in_features: int, kernels, interleaved: bool):
        self.type_name, self.rows, self.in_features = type_name, rows, in_features
        self.kernels, self.interleaved = kernels, interleaved
        self.register_buffer("raw", raw)

    @classmethod
    def of_head(cls, head: KQuantLinear) -> KQuantRows:
        """The rows of a tied head's one run of rows, in whichever layout it runs them."""
        (entry, _, _, rows), = head.segments
        table = cls.__new__(cls)
        nn.Module.__init__(table)
        table._hold(head.type_names[0], head.raw0, rows, head.in_features, head.kernels, entry == "kx16")
        return table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            flat = self.kernels.kx16_dequant_rows(self.type_name, self.raw, self.rows, self.in_features,
                                                  ids.reshape(-1))
        else:
            flat = self.kernels.kq_dequant_rows(self.type_name, self.raw, self.in_features, ids.reshape(-1))
        return flat.view(*ids.shape, self.in_features)


class BF16Linear(FastAttributes, nn.Module):
    """A dense linear run on a bfloat16 copy of its weight (the output head over a tied, unquantized embedding),
    where it measured fastest for one row (see fastest_head)."""

    matmul_dtype = ACT

    def __init__(self, weight: torch.Tensor, row_multiple: int = 1):
        super().__init__()
        self.row_multiple = row_multiple  # rows of a call are padded to this (nanoserve/model/rows.py)
        self.register_buffer("weight_bf16", weight.detach().to(ACT).contiguous())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x.to(ACT), self.weight_bf16, None, self.row_multiple).to(x.dtype)


