"""TensorShard: which slice of a weight one rank of a tensor-parallel group holds, and the model it builds.

Megatron's split, as vLLM and SGLang use it. Each layer says how it is split (`parallel`, nanoserve/model/linear.py),
and the loader asks it for each checkpoint tensor it loads, so no checkpoint name is matched here:
- "column" (output rows split): the merged q/k/v and gate/up projections (by heads, kv heads and the intermediate
  size);
- "row" (input columns split): o_proj and down_proj, whose partial outputs one all-reduce adds up;
- "vocab" (vocabulary rows split, the last rank padded): the embedding and the output head;
- None (replicated): the norms (q/k norms are per head dimension, the same on every rank) and the rotary table.

A rank builds its model of the local sizes (heads / N, kv heads / N, intermediate / N, vocabulary / N padded up
to a multiple of N) and loads only its slices, so no rank holds the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanoserve.errors import ConfigError
from nanoserve.model.config import ModelConfig
from nanoserve.model.quant.blocks import (
    GROUP,
    GgufInt4Rows,
    Int4Blocks,
    Int8Blocks,
    KQuantBlocks,
)

SPLITS = ("column", "row", "vocab")


def workable_sizes(cfg: ModelConfig, up_to: int = 16) -> list[int]:
    """The tensor-parallel sizes this model's shapes allow (heads, kv heads and the intermediate size divide)."""
    return [n for n in range(1, up_to + 1)
            if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0 and cfg.intermediate_size % n == 0]


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """Refuse a size the model cannot be split into, naming the sizes that work."""
    if world < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {world}")
    if world in workable_sizes(cfg, max(16, world)):
        return
    parts = [f"{name} {value}" for name, value in (("attention heads", cfg.num_heads),
                                                   ("kv heads", cfg.num_kv_heads),
                                                   ("intermediate size", cfg.intermediate_size)) if value % world]
    sizes = ", ".join(map(str, workable_sizes(cfg)))
    raise ConfigError(f"tensor_parallel_size {world} does not divide this model's {' and '.join(parts)}; "
                      f"use a size that works ({sizes}), or, to measure {world} ranks, a random-weight checkpoint "
                      f"whose shapes divide: {random_checkpoint_command(world)}")


def random_checkpoint_command(world: int) -> str:
    """How to write (scripts/random-checkpoint.py) and load a random-weight checkpoint that `world` ranks can
    split, for a model that cannot: the default model's size with 8 heads over 4 kv heads when that divides, as
    the README's benchmark uses, else 2 heads per kv head over `world` kv heads (the intermediate size rounded up
    to a multiple)."""
    kv = 4 if 4 % world == 0 else world
    shape = {"--heads": 2 * kv, "--kv-heads": kv, "--intermediate": -(-1536 // world) * world}
    flags = "".join(f" {flag} {value}" for flag, value in shape.items()
                    if value != {"--heads": 8, "--kv-heads": 4, "--intermediate": 1536}[flag])
    out = f"/tmp/llama-{2 * kv}h"
    return f"write one with python scripts/random-checkpoint.py --out {out}{flags} and pass --model {out}"


@dataclass(frozen=True)
class TensorShard:
    rank: int
    world: int

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The sizes one rank's model is built with (the global config stays the engine's own)."""
        check_divisible(cfg, self.world)
        n = self.world
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                                   intermediate_size=cfg.intermediate_size // n,
                                   vocab_size=self.vocab_rows(cfg.vocab_size))

    def vocab_rows(self, vocab: int) -> int:
        return -(-vocab // self.world)

    def vocab_start(self, vocab: int) -> int:
        return self.rank * self.vocab_rows(vocab)

    def bounds(self, split: str | None, shape, name: str = "") -> tuple[int, int, int, int] | None:
        """(dim, start, stop, rows) of this rank's slice of a checkpoint tensor of `shape` for a layer split as
        `split` (see SPLITS): the slice is [start, stop) along `dim`, padded with zero rows up to `rows` (the
        vocabulary's last rank). None: the whole tensor (replicated). `name` is the tensor's, for errors."""
        if split is None or self.world == 1:
            return None
        if split not in SPLITS:
            raise ValueError(f"unknown tensor-parallel split {split!r} for {name}; one of {SPLITS}")
        if split == "vocab":
            vocab = shape[0]
            rows = self.vocab_rows(vocab)
            start = self.rank * rows
            return 0, start, min(start + rows, vocab), rows
        dim = 0 if split == "column" or len(shape) == 1 else 1
        size = shape[dim]
        if size % self.world:
            raise ConfigError(f"weight {name} has {size} {'rows' if dim == 0 else 'columns'}, which "
                              f"tensor_parallel_size {self.world} does not divide")
        step = size // self.world
        return dim, self.rank * step, (self.rank + 1) * step, step

    def take(self, split: str | None, tensor, name: str = ""):
        """This rank's slice of a checkpoint tensor (a dense tensor or quantized blocks) for a layer split as
        `split`."""
        where = self.bounds(split, tensor.shape, name)
        if where is None:
            return tensor
        dim, start, stop, rows = where
        part = _slice(tensor, dim, start, stop, name)
        return pad_rows(part, rows, name) if dim == 0 else part


def _slice(tensor, dim: int, start: int, stop: int, name: str = ""):
    """A copy of the slice alone, so the whole tensor it came from can be freed."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, stop - start).clone()
    return blocks_slice(tensor, dim, start, stop, name)


def blocks_slice(blocks, dim: int, start: int, stop: int, name: str = ""):
    """Quantized blocks cut along output rows (dim 0) or whole groups of input columns (dim 1)."""
    if isinstance(blocks, (KQuantBlocks, GgufInt4Rows)):
        part = blocks.slice(dim, start, stop)
        if part is None:
            unit = f"{'/'.join(blocks.type_names)} units of {blocks.unit}" if isinstance(blocks, KQuantBlocks) else \
                f"blocks of {GROUP}"
            raise ConfigError(f"weight {name}: a rank's {stop - start} input columns are not whole {unit}, so its "
                              "blocks cannot be split there; use another tensor_parallel_size or --quantization none")
        return part
    if dim == 0:
        index = slice(start, stop)
        if isinstance(blocks, Int4Blocks):
            return Int4Blocks(blocks.codes[index].clone(), blocks.scales[index].clone(), blocks.zeros[index].clone())
        return Int8Blocks(blocks.codes[index].clone(), blocks.scales[index].clone())
    if start % GROUP or stop % GROUP:
        raise ConfigError(f"weight {name}: a rank's {stop - start} input columns are not whole groups of {GROUP}, "
                          "so its quantized blocks cannot be split there; use another tensor_parallel_size or "
                          "--quantization none")
    groups = slice(start // GROUP, stop // GROUP)
    if isinstance(blocks, Int4Blocks):
        return Int4Blocks(blocks.codes[:, start:stop].contiguous(), blocks.scales[:, groups].contiguous(),
                          blocks.zeros[:, groups].contiguous())
    return Int8Blocks(blocks.codes[:, start:stop].contiguous(), blocks.scales[:, groups].contiguous())


def pad_rows(tensor, rows: int, name: str = ""):
    """The last rank's vocabulary slice padded with zero rows to the common width (their logits are dropped)."""
    have = tensor.shape[0]
    if have == rows:
        return tensor
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"weight {name}: a vocabulary of this size does not split evenly, and its quantized "
                          "blocks cannot be padded; use a tensor_parallel_size that divides the vocabulary")
    pad = torch.zeros(rows - have, *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, pad])
