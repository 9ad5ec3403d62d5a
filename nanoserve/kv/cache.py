"""KVCache: the K/V storage the block pool indexes, sized from a memory budget."""

from __future__ import annotations

import math
import mmap

import torch

from nanoserve.errors import ConfigError
from nanoserve.model.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


LAYOUTS = ("slots", "heads", "heads_kt")


def zero_filled(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros; on the CPU an anonymous mapping, whose pages the kernel zero-fills when first written, where
    torch.zeros faults in and writes every page at once: a 3B model's 784 MiB pool cost 1.0 s of a 3.4 s load,
    and was resident before it held a token. Its pages stay 4 KiB (no transparent huge pages, which numpy's
    large arrays ask for): a block is a page of each layer's kv head, and a 2 MiB page would make a first token
    resident for 512 blocks (half of a 1B model's 1 GiB pool after one 16-token prompt)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)  # a GPU's pool, or a system without mmap's flags
    try:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: a forked process gets a copy on write
    except OSError as e:
        raise MemoryError(f"the KV pool's {nbytes / 2**30:.2f} GiB cannot be mapped on this machine "
                          f"({e.strerror}); lower --kv-cache-gib") from None
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def kv_layout(config, fused: bool = False) -> str:
    """The layout an EngineConfig's attention reads: head-major for the batch-invariant attention, with K's blocks
    transposed when it runs on the fused CPU kernel (`fused`: the model runs on them)."""
    if not config.batch_invariant:
        return "slots"
    return "heads_kt" if fused else "heads"


class KVCache:
    """K and V for every layer; a token's slot is block * block_size + offset.

    Three layouts: "slots" keeps [layers, blocks, block_size, kv_heads, head_dim] (a slot's heads side by side: the
    gathered and streamed reads), "heads" keeps [layers, kv_heads, blocks, block_size, head_dim] (a head's blocks
    side by side: the batch-invariant attention gathers one contiguous span per kv head and row), "heads_kt" is
    "heads" with each K block transposed, [.., blocks, head_dim, block_size] (the fused CPU attention scores a
    block of keys per query with no horizontal sums; V is as in "heads").
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 layout: str = "slots"):
        if layout not in LAYOUTS:
            raise ValueError(f"KV layout {layout!r} is not one of {LAYOUTS}")
        kv, dim = cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_layers, num_blocks, block_size, kv, dim) if layout == "slots" else \
            (cfg.num_layers, kv, num_blocks, block_size, dim)
        k_shape = (cfg.num_layers, kv, num_blocks, dim, block_size) if layout == "heads_kt" else shape
        self.k = zero_filled(k_shape, dtype, device)
        self.v = zero_filled(shape, dtype, device)
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_heads = kv
        # each layer's storage as rows the write indexes, viewed once instead of on every write:
        # [slots, kv_heads, head_dim] ("slots") or [kv_heads * slots, head_dim] ("heads")
        rows = (-1, kv, dim) if layout == "slots" else (-1, dim)
        self._k_rows = [layer.view(*rows) for layer in self.k]
        self._v_rows = [layer.view(*rows) for layer in self.v]
        self._head_slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, their head-major rows)

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V storage (contiguous) for a kernel that writes slots itself (see write_strides)."""
        return self._k_rows[layer], self._v_rows[layer]

    @property
    def write_strides(self) -> tuple[int, int]:
        """(per slot, per kv head): element offsets of head h of slot s in a layer's storage."""
        dim = self.v.shape[-1]  # K of heads_kt ends in block_size
        if self.layout == "slots":
            return self.kv_heads * dim, dim
        return dim, self.num_blocks * self.block_size * dim

    @property
    def k_block(self) -> int:
        """Keys per transposed K block for the fused rotary write (heads_kt), else 0 (K rows as V's)."""
        return self.block_size if self.layout == "heads_kt" else 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store this step's K/V rows ([tokens, kv_heads, head_dim]) at their slots."""
        if self.layout == "heads_kt":
            raise ValueError("a heads_kt cache is written by the fused kernels (KVCache.k_block)")
        if self.layout == "slots":
            self._k_rows[layer].index_copy_(0, slots, k)
            self._v_rows[layer].index_copy_(0, slots, v)
            return
        rows = self._rows_of(slots)
        self._k_rows[layer].index_copy_(0, rows, k.transpose(0, 1).reshape(-1, k.shape[-1]))
        self._v_rows[layer].index_copy_(0, rows, v.transpose(0, 1).reshape(-1, v.shape[-1]))

    def _rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The head-major rows of `slots` (head h of slot s is row h * slots_per_head + s), computed once a step:
        every layer writes the same slots."""
        if self._head_slots is None or self._head_slots[0] is not slots:
            per_head = self.num_blocks * self.block_size
            heads = torch.arange(self.kv_heads, device=slots.device)[:, None] * per_head
            self._head_slots = (slots, (slots[None, :] + heads).reshape(-1))
        return self._head_slots[1]


def blocks_from_budget(cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    per_block = bytes_per_block(cfg, block_size, dtype)
    blocks = int(budget_bytes // per_block)
    if blocks < 2:
        raise ConfigError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {blocks} blocks of {per_block / 2**20:.2f} MiB; "
            "raise --kv-cache-gib (or --gpu-memory-utilization on CUDA)"
        )
    return blocks
