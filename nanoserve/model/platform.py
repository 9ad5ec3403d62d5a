"""Platform: what this machine runs a model's layers with, decided once before the model is built.

A model is built with it and its layers keep what they need (the fused CPU kernels, the tensor-parallel group's
reduction): nothing is swapped or injected into a model after it is constructed, so its forward is one path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Platform:
    kernels: object | None = None  # FusedKernels (nanoserve/kernels/fused.py) the CPU decoder runs on, or None
    group: object | None = None  # tensor parallel: the rank group (reduce, embed), or None on one device
    vocab_start: int = 0  # tensor parallel: the first token id of this rank's slice of the vocabulary
    dtype: torch.dtype = torch.float32  # the model's dense weights
    row_multiples: dict = field(default_factory=dict)  # dtype -> rows a dense matmul's calls are padded to

    def row_multiple(self, dtype: torch.dtype | None = None) -> int:
        """The row multiple of a dense matmul in `dtype` (the model's by default): 1 unless batch-invariant."""
        return self.row_multiples.get(dtype or self.dtype, 1)

    def reduce(self):
        """What sums a row-parallel projection's partial outputs across ranks (None: one device, no sum)."""
        return None if self.group is None else self.group.reduce


EAGER = Platform()  # torch's ops on one device
