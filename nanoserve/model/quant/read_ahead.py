"""Which weight the next matmul reads, so an idle kernel thread can ask memory for it early (`--read-ahead`).

A CPU decode token is bound by memory: its matmuls stream every weight once, and between them the caller runs
norms, rotary, attention and Python while the bus idles (about an eighth of a 1B model's token). The fused
library's idle pool worker can ask for the next weight's first bytes in that time (kernels/linear.c,
ns_read_ahead), if it knows which weight comes next. The order is learned, not declared: each packed linear
records the one called after it, so any model family's layer order (merged projections, a tied head, the next
step's first layer after the head) is followed as it runs. A wrong guess costs a little bandwidth, never a
value: the hint only moves bytes into the cache.
"""

from __future__ import annotations

import torch
from torch import nn

AHEAD_ROWS = 16  # calls of at most this many rows (decode steps) name the next weight


class ReadAheadChain:
    """The packed linears of one model in the order they were last called: before each call, the linear called
    before it is linked to it and its own successor's weight is named to the kernels, whose worker reads it from
    the moment it has no more of this call's work."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.last = None

    def before(self, linear, rows: int) -> None:
        """`linear` is about to run a call of `rows` rows. Only a few rows' calls name the next weight: a call of
        many is bound by compute, its next one too, and the gap between them is the tensor ops' (measured: 512-row
        prefill 0.97x with every call naming it)."""
        last = self.last
        if last is not None and last is not linear and last.read_next is not linear.read_span:
            last.read_next = linear.read_span  # only when it changes: a module's setattr is a Python call
        self.last = linear
        if rows <= AHEAD_ROWS and linear.read_next is not None:
            self.kernels.read_ahead(*linear.read_next)
        else:
            self.kernels.read_ahead(None, 0)


def first_weight(linear: nn.Module) -> tuple[int, int] | None:
    """(address, bytes) of the buffer a packed linear's kernel reads first: its packed weight or its first run of
    file rows; None for one with no uint8 buffer (a dense weight)."""
    for _, buffer in linear.named_buffers(recurse=False):
        if buffer.dtype == torch.uint8 and buffer.numel():
            return buffer.data_ptr(), buffer.numel()
    return None


def install_read_ahead(model: nn.Module, kernels) -> int:
    """Gives every packed linear of `model` on `kernels` one shared chain; returns how many joined it."""
    from nanoserve.model.quant.linears import PackedLinear

    chain, joined = ReadAheadChain(kernels), 0
    for module in model.modules():
        if isinstance(module, PackedLinear) and getattr(module, "kernels", None) is kernels:
            span = first_weight(module)
            if span is not None:
                module.read_span, module.read_chain = span, chain
                joined += 1
    return joined
