"""Where a checkpoint tensor goes in a built model: its layer, which of the layer's tensors, which shard of a
merged projection, and so how tensor parallelism splits it (the layer's `parallel`, nanoserve/model/linear.py).

A model class maps checkpoint projections onto its merged ones with PACKED (fragment -> (merged module, shard));
everything else is found by its own name. The loader reads a tensor (or only a rank's slice of it) and loads it
through here, so a new architecture adds its layers and its PACKED table, not rules about names.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


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
