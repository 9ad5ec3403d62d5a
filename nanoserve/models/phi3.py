"""Phi-3 and Phi-4: the Llama decoder (nanoserve/models/llama.py) on checkpoints that store the attention's q, k and
v projections as one `qkv_proj` and the MLP's gate and up projections as one `gate_up_proj`, rows in that order.

The function is the Llama decoder's (RMSNorm, rotary attention with LongRoPE where the config asks, a SiLU-gated
MLP); only the checkpoint's layout differs, so the class says how its fused tensors split (FUSED) and the loader
hands each projection to the merged layers as a Llama checkpoint would.
"""

from __future__ import annotations

from nanoserve.model.config import ModelConfig
from nanoserve.models.llama import LlamaForCausalLM


def qkv_rows(cfg: ModelConfig) -> list[tuple[str, int]]:
    return [("q_proj", cfg.num_heads * cfg.head_dim), ("k_proj", cfg.num_kv_heads * cfg.head_dim),
            ("v_proj", cfg.num_kv_heads * cfg.head_dim)]


def gate_up_rows(cfg: ModelConfig) -> list[tuple[str, int]]:
    return [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]


class Phi3ForCausalLM(LlamaForCausalLM):
    FUSED = {"qkv_proj": qkv_rows, "gate_up_proj": gate_up_rows}
