"""The quantized linear seam: a checkpoint's quantized weights kept packed, and the kernel chosen by how many rows
a call has and by what this machine measures.

blocks.py holds a file's blocks exactly (Int4Blocks, GgufInt4Rows, Int8Blocks, KQuantBlocks); linears.py the
packed linears that run them on torch's weight-only CPU kernels and the fused library's; methods.py has one linear method per weight format,
which packs a projection's loaded weights into those modules; install.py runs the methods over a loaded model,
chooses the output head's form and publishes what it did.
Activations into torch's kernels are bfloat16 (they are vectorised for nothing else); the fused library's q4x16
kernel (Q4Linear) takes float32 and quantizes each row's groups of 32 to int8 itself. Everything around the
linears, attention included, stays in the model's own dtype.
"""

from nanoserve.model.quant.blocks import (
    GROUP,
    HALF_UNIT,
    KEPT_GGUF_TYPES,
    GgufInt4Rows,
    Int4Blocks,
    Int8Blocks,
    KQuantBlocks,
    QuantBlocks,
    from_gguf,
)
from nanoserve.model.quant.install import (
    DENSE_MARGIN,
    QuantStats,
    dense_crossover,
    fastest_head,
    head_forms,
    head_timings,
    process_weights,
)
from nanoserve.model.quant.linears import (
    ACT,
    BF16Linear,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    KQuantLinear,
    PackedLinear,
    Q4Linear,
    int4_supported,
    int8_supported,
)

__all__ = [
    "ACT", "DENSE_MARGIN", "GROUP", "HALF_UNIT", "KEPT_GGUF_TYPES", "BF16Linear", "GgufInt4Rows", "Int4Blocks", "Int4Linear",
    "Int8Blocks",
    "Int8GroupLinear", "Int8Linear", "KQuantBlocks", "KQuantLinear", "PackedLinear", "Q4Linear", "QuantBlocks", "QuantStats", "dense_crossover",
    "fastest_head", "from_gguf", "head_forms", "head_timings", "int4_supported", "process_weights",
    "int8_supported",
]
