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


def pad_dense_rows(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Set each dense linear's row multiple to the one its dtype needs here; returns the dtypes that have none
    (their matmuls are not row-invariant on this machine, whatever the padding)."""
    from nanoserve.invariance import linear_row_multiple

    lacking = []
    for module in model.modules():
        dtype = getattr(module, "matmul_dtype", None)
        if dtype is None:
            continue
        multiple = linear_row_multiple(dtype, device.type)
        if multiple is None:
            lacking.append(str(dtype).removeprefix("torch."))
        module.row_multiple = multiple or 1
    return sorted(set(lacking))
