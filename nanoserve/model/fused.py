"""Whether the CPU decoder runs on the fused kernels (nanoserve/kernels/fused.c), and what they served.

They run where they can: the flag on, the model on the CPU in float32 (its residual stream and norms), and a C
compiler to build them with. Anywhere else the eager torch ops run, and `reason` says why, so a flag that did not
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
    read_ahead_linears: int = 0  # packed linears whose successor's weight is read ahead (--read-ahead)
    read_ahead_off: str = ""  # why none is, when the flag is off
    huge_pages: object | None = None  # HugePageMover (kernels/pages.py): the packed weights moved onto huge pages

    def as_dict(self) -> dict:
        out = {"active": self.active, "reason": self.reason}
        if self.kernels is not None:
            out.update(library=self.kernels.path, calls=dict(self.kernels.calls), rows=dict(self.kernels.rows),
                       q4_isa=self.kernels.q4_isa, tiles=self.kernels.tiles,
                       tile_rows=self.kernels.tile_rows, kquant=self.kquant(), read_ahead=self.read_ahead(),
                       huge_pages=None if self.huge_pages is None else self.huge_pages.status())
        return out

    def read_ahead(self) -> dict:
        """How many linears name their successor's weight, and the bytes the idle worker asked memory for since
        the library loaded (counted in C as it asks; 0 on one thread, which has no idle worker)."""
        return {"linears": self.read_ahead_linears, "asked_bytes": self.kernels.read_ahead_bytes,
                "off": self.read_ahead_off}

    def kquant(self) -> dict:
        """The GGUF types multiplied in the file's blocks (kernels/kquant.c) and the instruction set they were
        built for; "portable" (no vector path on this machine) is said, never a silent scalar loop."""
        isa = self.kernels.kq_isa
        note = "" if isa != "portable" else \
            "plain C: this machine has none of AVX-512 VNNI, AVX2 or ARM's dot product instructions (no vector path)"
        return {"isa": isa, "vectorized": isa != "portable", "types": sorted(self.kernels.kq_types), "note": note}


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


def fused_status(kernels, reason: str, dtype: torch.dtype) -> FusedStatus:
    """Whether a model of `dtype` runs on `kernels` (from fused_kernels; None: `reason` says why there are none):
    decided before the model is built, which then holds them in its layers (nanoserve/model/platform.py)."""
    if kernels is None:
        return FusedStatus(False, reason)
    if dtype != torch.float32:
        return FusedStatus(False, f"the residual stream is {str(dtype).removeprefix('torch.')}; the fused kernels "
                                  "take float32")
    return FusedStatus(True, "", kernels)
