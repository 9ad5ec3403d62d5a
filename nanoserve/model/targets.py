"""Where a checkpoint tensor goes in a built model: its layer, which of the layer's tensors, which shard of a
merged projection, and so how tensor parallelism splits it (the layer's `parallel`, nanoserve/model/linear.py).

A model class maps checkpoint projections onto its merged ones with PACKED (fragment -> (merged module, shard));
everything else is found by its own name. A checkpoint that stores a merged projection whole (Phi-3's qkv_proj and
gate_up_proj) is split into its projections first (`fused_parts`, from the class's FUSED table), so the rest of
loading, tensor-parallel slicing included, sees the projections one by one. The loader reads a tensor (or only a
rank's slice of it) and loads it through here, so a new architecture adds its layers and its PACKED (and FUSED)
table, not rules about names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.errors import CheckpointError
from nanoserve.parallel.shard import blocks_slice


@dataclass(frozen=True)
class Target:
    module: nn.Module
    path: str  # the module's path in the model
    kind: str  # which of its tensors: "weight", "bias"
    shard: str | None = None  # a merged projection's shard (its checkpoint projection), else None

    @property
    def split(self) -> str | None:
        """How tensor parallelism splits this tensor: the layer's `parallel` ("column", "row", "vocab"), or None
        (replicated: norms)."""
        return getattr(self.module, "parallel", None)


def weight_target(model: nn.Module, name: str) -> Target | None:
    """The target of checkpoint tensor `name` in `model`, or None when the model has no such layer."""
    key = name.removeprefix("model.")
    if "." not in key:
        return None
    path, kind = key.rsplit(".", 1)
    shard = None
    for fragment, (merged, part) in model.PACKED.items():
        if f".{fragment}." in f".{key}":
            path, shard = path.replace(fragment, merged), part
            break
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return Target(module, path, kind, shard)


def split_of(model: nn.Module, name: str) -> str | None:
    """How tensor parallelism splits checkpoint tensor `name` for `model` (None: whole, or not the model's)."""
    target = weight_target(model, name)
    return None if target is None else target.split


def _fused(model: nn.Module, name: str):
    """(fragment, parts) when checkpoint tensor `name` holds several of `model`'s projections whole, else None."""
    return next(((fragment, parts) for fragment, parts in getattr(model, "FUSED", {}).items()
                 if f".{fragment}." in f".{name}"), None)


def is_fused(model: nn.Module, name: str) -> bool:
    return _fused(model, name) is not None


def fused_parts(model: nn.Module, name: str, tensor) -> list[tuple[str, object]]:
    """A checkpoint tensor that holds several projections whole (the class's FUSED: fragment -> a function of the
    config giving each projection's fragment and rows, in order) split into each projection's (checkpoint name,
    rows)."""
    fragment, parts = _fused(model, name)
    named = parts(model.config)
    local = sum(rows for _, rows in named)
    # a tensor-parallel rank's model has its share of every projection: the whole tensor is `ranks` times it
    ranks = tensor.shape[0] // local if local and tensor.shape[0] % local == 0 else 0
    if not ranks:
        raise CheckpointError(f"weight {name} has {tensor.shape[0]} rows but the config implies a multiple of {local} "
                              f"({' + '.join(f'{p} {r}' for p, r in named)}); config.json does not match the "
                              "weights")
    sizes = [rows * ranks for _, rows in named]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(name.replace(f".{fragment}.", f".{part}."), _rows(tensor, start, start + rows, name))
            for (part, _), start, rows in zip(named, starts, sizes)]


def _rows(tensor, start: int, stop: int, name: str):
    """Rows [start, stop) of a dense tensor (a view) or of quantized blocks (a GGUF file's fused tensor)."""
    if isinstance(tensor, torch.Tensor):
        return tensor[start:stop]
    return blocks_slice(tensor, 0, start, stop, name)
