"""Linear methods: one per weight format, each saying how a projection in that format is packed and multiplied.

A projection's weights arrive dense or as a file's blocks (nanoserve/model/quant/blocks.py). After loading, the
method for the blocks' kind on this machine (`method_for`, or `quantizing_method` for a --quantization mode over
dense weights) processes them into the packed module (nanoserve/model/quant/linears.py) that the layer then runs
(LinearLayer.use_packed). The choice is made once, at load, from the format and the machine (the fused CPU kernels
or torch's): adding a weight format is its blocks, its kernel module and one method registered here.
"""

from __future__ import annotations

import torch

from nanoserve.model.quant.blocks import (
    GgufInt4Rows,
    Int4Blocks,
    Int8Blocks,
    KQuantBlocks,
    QuantBlocks,
)
from nanoserve.model.quant.linears import (
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    KQuantLinear,
    PackedLinear,
    Q4Linear,
    Q4x8Linear,
    Q8Linear,
    int4_packable,
)


class LinearMethod:
    """How one weight format is held and multiplied: `process` packs a projection's loaded weights (its blocks,
    bias and merged-shard sizes) into the module that serves its calls."""

    format = ""

    def packs(self, out: int, k: int) -> bool:
        """Whether this format's kernel takes an out x k weight (else the projection stays dense)."""
        return int4_packable(out, k)

    def process(self, blocks: QuantBlocks, bias: torch.Tensor | None, sizes: list[int] | None) -> PackedLinear:
        raise NotImplementedError


class Q4Fused(LinearMethod):
    """4-bit blocks on the fused library's 4-bit x 16-bit kernel (row-invariant, float32 in and out)."""

    format = "q4x16"

    def __init__(self, kernels):
        self.kernels = kernels

    def process(self, blocks, bias, sizes):
        if isinstance(blocks, GgufInt4Rows) and blocks.type_name == "Q4_0":  # llama.cpp's 8-bit activations
            return Q4x8Linear(blocks, bias, sizes, self.kernels)
        return Q4Linear(blocks, bias, sizes, self.kernels)


class Int4Torch(LinearMethod):
    """4-bit blocks on torch's packed int4 CPU kernel (bfloat16 activations)."""

    format = "int4"

    def process(self, blocks, bias, sizes):
        return Int4Linear(blocks, bias, sizes)


class Q8Fused(LinearMethod):
    """8-bit blocks (GGUF Q8_0) as they are, on the fused library's 8-bit x 16-bit kernel, where it is vectorized."""

    format = "q8x16"

    def __init__(self, kernels):
        self.kernels = kernels

    def process(self, blocks, bias, sizes):
        return Q8Linear(blocks, bias, sizes, self.kernels)


class Int8Planes(LinearMethod):
    """8-bit blocks as two 4-bit planes on a 4-bit kernel: the fused library's when given, else torch's."""

    format = "int8g32"

    def __init__(self, kernels=None):
        self.kernels = kernels

    def process(self, blocks, bias, sizes):
        return Int8GroupLinear(blocks, bias, sizes, kernels=self.kernels)


class Int8Rows(LinearMethod):
    """A dense weight re-rounded to int8 per output row on torch's int8 kernel (--quantization int8)."""

    format = "int8"

    def packs(self, out: int, k: int) -> bool:
        return True

    def process(self, weight, bias, sizes):
        return Int8Linear(weight, bias, sizes)


class KQuantFused(LinearMethod):
    """GGUF K-quant super-blocks as the file holds them, on the fused library's K-quant kernels."""

    format = "kquant"

    def __init__(self, kernels, unit: int):
        self.kernels, self.unit = kernels, unit  # the inputs its type's rows come in whole runs of

    def packs(self, out: int, k: int) -> bool:
        return k % self.unit == 0

    def process(self, blocks, bias, sizes):
        return KQuantLinear(blocks, bias, sizes, self.kernels)


class Dequantized(LinearMethod):
    """Blocks no kernel here runs (the K-quants without the fused library): the projection stays dense, its
    weight the blocks dequantized, one projection at a time as they are installed."""

    format = "dense"

    def packs(self, out: int, k: int) -> bool:
        return False


def _int4(kernels, blocks) -> LinearMethod:
    return Q4Fused(kernels) if kernels is not None else Int4Torch()


def _int8(kernels, blocks) -> LinearMethod:
    return Q8Fused(kernels) if kernels is not None and kernels.q8_vectorized else Int8Planes(kernels)


def _kquant(kernels, blocks) -> LinearMethod:
    return KQuantFused(kernels, blocks.unit) if kernels is not None else Dequantized()


# a file's blocks -> the method that runs them, given the fused kernels (or None)
METHODS = {Int4Blocks: _int4, GgufInt4Rows: _int4, Int8Blocks: _int8, KQuantBlocks: _kquant}


def method_for(blocks: QuantBlocks, kernels=None) -> LinearMethod:
    """The method for a projection whose weights came as `blocks`, on this machine."""
    return METHODS[type(blocks)](kernels, blocks)


def quantizing_method(mode: str, weight: torch.Tensor, kernels=None) -> tuple[LinearMethod, object] | None:
    """(method, the weights it processes) for a dense projection under --quantization `mode`: "int4" rounds the
    weight to 4-bit blocks (where the kernel takes its shape), "int8" to int8 rows; None: it stays dense."""
    if mode == "int4" and int4_packable(*weight.shape):
        blocks = Int4Blocks.quantize(weight)
        return _int4(kernels, blocks), blocks
    if mode == "int8":
        return Int8Rows(), weight
    return None
