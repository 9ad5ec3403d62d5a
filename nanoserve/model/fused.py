"""Whether the CPU decoder runs on the fused kernels (nanoserve/kernels/fused.c), and what they served.

They run where they can: the flag on, the model on the CPU with a float32 residual stream and float32 norms, and a
C compiler to build them with. Anywhere else the eager torch ops run, and `reason` says why, so a flag that did not
take effect is never silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FusedStatus:
    active: bool
    reason: str = ""  # why not, when inactive
    kernels: object | None = None  # FusedKernels

    def as_dict(self) -> dict:
        out = {"active": self.active, "reason": self.reason}
        if self.kernels is not None:
            out.update(library=self.kernels.path, calls=dict(self.kernels.calls), rows=dict(self.kernels.rows),
                       q4_isa=self.kernels.q4_isa, tiles=self.kernels.tiles,
                       tile_rows=self.kernels.tile_rows)
        return out


def fused_kernels(enabled: bool, device: torch.device):
    """(FusedKernels, "") for a model about to load on `device`, or (None, why not): the flag off, not a CPU, or
    no library (no compiler, or a build this machine cannot run). Loaded before the weights, since the 4-bit
    linears are packed for its kernel as they load."""
    if not enabled:
        return None, "--no-fused-cpu-kernels"
    if device.type != "cpu":
        return None, f"the fused kernels are CPU kernels; this model runs on {device.type}"
    from nanoserve.kernels.fused import load

    return load()


def why_not(model) -> str:
    """Why this model cannot run on the fused decoder kernels ("" when it can)."""
    stream = model.embed_tokens.weight.dtype
    if stream != torch.float32:
        return f"the residual stream is {str(stream).removeprefix('torch.')}; the fused kernels take float32"
    norms = [m.weight.dtype for name, m in model.named_modules() if name.endswith("layernorm")]
    if any(dtype != torch.float32 for dtype in norms):
        return "the norms are not float32"
    return ""


def install_fused(model, kernels, reason: str = "") -> FusedStatus:
    """Switch `model` onto `kernels` (from fused_kernels; None: `reason` says why there are none) when it can run
    them; the status says which, and why not."""
    if kernels is None:
        return FusedStatus(False, reason)
    reason = why_not(model)
    if reason:
        return FusedStatus(False, reason)
    model.use_fused(kernels)
    return FusedStatus(True, "", kernels)
