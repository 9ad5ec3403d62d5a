"""AttentionStep: one step's attention, which every layer of the model calls in turn with its own queries.

Built once a step by PagedRead.step from the step's batch and the KV cache, it holds what the layers share:
which tokens are decode rows and which prefill segments, the slots their keys and values go to, and each path's
own metadata (a gathered mask, block tables, prefix groups), built here or by the first layer's call. A layer
only rotates its q and k, hands k and v to `store` (or writes them itself on the fused kernels, where
`cached_only`), and calls `attend`: the KV layout and the paths stay behind this seam.
"""

from __future__ import annotations

import torch


class AttentionStep:
    """The shape every attention path of a step takes (nanoserve/attention/dispatch.py, invariant.py, fused.py)."""

    cached_only = True  # attention reads every key from the cache: a layer writes k and v there and keeps none

    def __init__(self, read, batch, cache):
        self.read, self.batch, self.cache = read, batch, cache

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's k and v for the step's tokens ([tokens, kv_heads, head_dim]) at their slots."""
        self.cache.write(layer, k, v, self.batch.slots)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """Attention of every token of the step, in token order: q [tokens, heads, dim] -> the same shape. k and v
        are the step's own ([tokens, kv_heads, dim]), needed only where not `cached_only` (else None)."""
        raise NotImplementedError
