"""Row padding for the dense matmuls, so a row's numbers do not depend on how many rows share its call.

MKL's float32 matmul computes the rows of a call of 1, 2-3 or 5-11 rows another way than those of a call whose
row count is a multiple of 4 (nanoserve/invariance.py measures the multiple on each machine); padding every call
up to that multiple with zero rows gives a row the same numbers alone, in a crowd and inside a prefill. The
packed int4 kernel and the bfloat16 matmul need no padding (a multiple of 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    """F.linear on x [rows, in] with the rows padded to a multiple of `multiple` (and the padding dropped)."""
    rows = x.shape[0]
    extra = -rows % multiple
    if not extra or x.dim() != 2:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, extra)), weight, bias)[:rows]


def row_multiples(dtypes, device: torch.device, invariant: bool) -> dict[torch.dtype, int]:
    """dtype -> the row multiple its dense matmuls are padded to here: measured for a batch-invariant model (a
    dtype none holds for gets 1, and nanoserve/invariance.py reports it), 1 otherwise. Measured before a model is
    built: its linears are given theirs as they are constructed (on the meta device, where nothing can run)."""
    if not invariant:
        return {}
    from nanoserve.invariance import linear_row_multiple

    return {dtype: linear_row_multiple(dtype, device.type) or 1 for dtype in dtypes}
