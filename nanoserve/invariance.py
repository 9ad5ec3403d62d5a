"""Which call shapes this machine's kernels compute a row of independently of the rows beside it.

Batch invariance rests on one property of every kernel a row meets: the numbers of a row do not depend on how many
rows share the call. It is a property of the machine and the build (the BLAS, its instruction set), not of timing,
so it is checked exactly, on fixed seeded inputs, once a process:

- a dense matmul in each dtype: the smallest multiple of rows (1, 4, 8 or 16) such that a row computed in a call
  of any row count, padded up to that multiple, equals the same row computed alone. MKL's float32 matmul
  needs 4 on the machines measured (a call of 1, 2, 3, or of 5 to 11 rows, computes its rows another way);
  torch's bfloat16 matmul needs 1;
- the attention's batched matmuls (nanoserve/attention/invariant.py), with their rows padded to ROW_MULTIPLE.

Where a kernel has no such multiple the engine says so (`batch_invariant` false in the snapshot, with the reason)
instead of claiming what it cannot hold.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ROW_MULTIPLES = (1, 4, 8, 16)
_SHAPES = ((64, 48), (576, 576), (1536, 192))  # (in, out): a head's width, a hidden size, an MLP's
_MAX_ROWS = 40


def _pad_rows(x: torch.Tensor, extra: int) -> torch.Tensor:
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


def _rows_agree(fn, x: torch.Tensor, multiple: int) -> bool:
    """Every row (dim 0) of fn over the first m rows of x (m = 1.._MAX_ROWS, zero rows added up to `multiple`)
    equals that row computed alone."""
    alone = torch.cat([fn(_pad_rows(x[i:i + 1], multiple - 1))[:1] for i in range(x.shape[0])])
    for rows in range(1, x.shape[0] + 1):
        padded = -(-rows // multiple) * multiple
        if not torch.equal(fn(_pad_rows(x[:rows], padded - rows))[:rows], alone[:rows]):
            return False
    return True


@functools.cache
def linear_row_multiple(dtype: torch.dtype, device_type: str) -> int | None:
    """The smallest row multiple at which F.linear in `dtype` is row-invariant here; None if none is."""
    g = torch.Generator().manual_seed(0)
    for multiple in ROW_MULTIPLES:
        ok = True
        for k, n in _SHAPES:
            w = torch.randn(n, k, generator=g).to(dtype).to(device_type)
            x = torch.randn(_MAX_ROWS, k, generator=g).to(dtype).to(device_type)
            if not _rows_agree(lambda rows, w=w: F.linear(rows, w), x, multiple):
                ok = False
                break
        if ok:
            return multiple
    return None


@functools.cache
def attention_holds(device_type: str) -> str | None:
    """None when the invariant attention's matmuls are row-invariant here; else why not."""
    from nanoserve.attention.invariant import ROW_MULTIPLE, TILE

    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 3 * TILE, 64, generator=g).to(device_type)
    values = torch.randn(3, TILE, 64, generator=g).to(device_type)
    queries = torch.randn(3, _MAX_ROWS, 64, generator=g).to(device_type)
    for name, fn, x in (
        ("scores (q.k over head_dim)", lambda q: torch.bmm(q, keys.transpose(1, 2)), queries),
        ("values (p @ v over a tile)", lambda p: torch.bmm(p, values), torch.rand(3, _MAX_ROWS, TILE, generator=g)
         .to(device_type)),
    ):
        batched = _rows_agree(lambda rows, fn=fn: fn(rows.transpose(0, 1)).transpose(0, 1), x.transpose(0, 1),
                              ROW_MULTIPLE)
        if not batched:
            return f"this machine's batched {name} matmul is not row-invariant at a multiple of {ROW_MULTIPLE}"
    return None


@functools.cache
def packed_holds(kind: str) -> bool:
    """Whether torch's packed CPU kernel `kind` ("int4" or "int8") computes a row alike in calls of any rows."""
    from nanoserve.model.quant.blocks import Int4Blocks
    from nanoserve.model.quant.linears import Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 576, generator=g)
    linear = Int4Linear(Int4Blocks.quantize(w), None) if kind == "int4" else Int8Linear(w)
    return _rows_agree(linear.packed_mm, torch.randn(_MAX_ROWS, 576, generator=g).to(torch.bfloat16), 1)


def report(model: torch.nn.Module, device: torch.device) -> str | None:
    """None when batch invariance holds on `device` for every kernel `model` runs; else the first reason not."""
    from nanoserve.model.quant.linears import PackedLinear

    reason = attention_holds(device.type)
    if reason is not None:
        return reason
    packed = {m.format for m in model.modules() if isinstance(m, PackedLinear)}
    for kind in sorted(packed - {"q4x16", "q4x8", "q8x16", "kquant"}):  # nanoserve's own row-invariant kernels
        base = "int8" if kind == "int8" else "int4"  # int8g32 runs on the int4 kernel
        if not packed_holds(base):
            return f"torch's packed {base} kernel is not row-invariant on this machine"
    dtypes = {m.matmul_dtype for m in model.modules() if getattr(m, "matmul_dtype", None) is not None}
    for dtype in sorted(dtypes, key=str):
        if linear_row_multiple(dtype, device.type) is None:
            return f"this machine's {str(dtype).removeprefix('torch.')} matmul is not row-invariant at any of " \
                   f"{ROW_MULTIPLES} rows"
    return None
