"""KVCache: the K/V storage the block pool indexes, sized from a memory budget."""

from __future__ import annotations

import torch

from nanoserve.errors import ConfigError
from nanoserve.model.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVCache:
    """K and V as [layers, blocks, block_size, kv_heads, head_dim]; a token's slot is block * block_size + offset."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # each layer's storage as [slots, kv_heads, head_dim], viewed once instead of on every write
        self._k_slots = [layer.view(-1, *shape[-2:]) for layer in self.k]
        self._v_slots = [layer.view(-1, *shape[-2:]) for layer in self.v]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store this step's K/V rows ([tokens, kv_heads, head_dim]) at their slots."""
        self._k_slots[layer].index_copy_(0, slots, k)
        self._v_slots[layer].index_copy_(0, slots, v)


def blocks_from_budget(cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    per_block = bytes_per_block(cfg, block_size, dtype)
    blocks = int(budget_bytes // per_block)
    if blocks < 2:
        raise ConfigError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {blocks} blocks of {per_block / 2**20:.2f} MiB; "
            "raise --kv-cache-gib (or --gpu-memory-utilization on CUDA)"
        )
    return blocks
