"""The Llama decoder, which Mistral, Qwen2 (qkv biases) and Qwen3 (per-head q/k norms) share.

One forward: every choice of how to run it (fused CPU kernels or torch's ops, a tensor-parallel reduction) was made
when it was built, from its Platform (nanoserve/model/platform.py), and lives in its layers.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.attention.dispatch import PagedRead
from nanoserve.attention.step import AttentionStep
from nanoserve.kv.cache import KVCache
from nanoserve.model.attrs import FastAttributes
from nanoserve.model.batch import StepBatch
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import RMSNorm, RotaryEmbedding, act_and_mul, apply_rope
from nanoserve.model.linear import LMHead, MergedColumnLinear, RowParallelLinear, VocabEmbedding
from nanoserve.model.platform import EAGER, Platform


class Attention(FastAttributes, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, platform: Platform):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = MergedColumnLinear(
            cfg.hidden_size,
            {"q_proj": self.heads * self.dim, "k_proj": self.kv_heads * self.dim, "v_proj": self.kv_heads * self.dim},
            bias=cfg.attention_bias, row_multiple=platform.row_multiple(),
        )
        self.o_proj = RowParallelLinear(self.heads * self.dim, cfg.hidden_size, row_multiple=platform.row_multiple())
        self.q_norm = RMSNorm(self.dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.dim**-0.5
        self.fused = platform.kernels  # rotary + KV write in one pass of fused.c
        self.reduce = platform.reduce()  # sums the row-parallel o_proj's partial outputs across ranks

    def forward(self, x: torch.Tensor, rope: tuple, step: AttentionStep) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # forward itself: no hooks to run
        if self.fused is not None and step.cached_only:
            q, k, v = self._rotate_and_write_fused(qkv, rope, step), None, None  # attention reads the cache
        else:
            q, k, v = self._rotate_and_write(qkv.to(step.cache.k.dtype), rope, step)
        out = step.attend(self.layer, q, k, v, self.scale)
        out = self.o_proj.forward(out.reshape(tokens, self.heads * self.dim))
        return out if self.reduce is None else self.reduce(out)

    def _rotate_and_write(self, qkv: torch.Tensor, rope: tuple, step: AttentionStep):
        """q and k rotated (after Qwen3's per-head norms), k and v stored for the step: eager torch ops. qkv is in
        the cache's dtype (a packed projection answers in bfloat16)."""
        tokens = qkv.shape[0]
        q_end = self.heads * self.dim
        k_end = q_end + self.kv_heads * self.dim
        v = qkv[:, k_end:].view(tokens, self.kv_heads, self.dim)
        if self.q_norm is None:  # q and k are adjacent in qkv: one rotation turns both
            qk = apply_rope(qkv[:, :k_end].view(tokens, self.heads + self.kv_heads, self.dim), *rope)
            q, k = qk[:, : self.heads], qk[:, self.heads:]
        else:
            q = self.q_norm(qkv[:, :q_end].view(tokens, self.heads, self.dim))
            k = self.k_norm(qkv[:, q_end:k_end].view(tokens, self.kv_heads, self.dim))
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        step.store(self.layer, k, v)
        return q, k, v

    def _rotate_and_write_fused(self, qkv: torch.Tensor, rope: tuple, step: AttentionStep):
        """The same in one pass of fused.c: q [tokens, heads, dim] float32 back, k and v only in the cache."""
        cache = step.cache
        if cache.k.dtype != torch.float32:
            raise ValueError(f"the fused CPU kernels take a float32 KV cache, not {cache.k.dtype}; run with "
                             "--no-fused-cpu-kernels")
        k_cache, v_cache = cache.layer_rows(self.layer)
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        return self.fused.rope_store(qkv, self.heads, self.kv_heads, self.dim, *rope, *norms, eps, k_cache, v_cache,
                                     step.batch.slots, cache.write_strides, cache.k_block)


class MLP(FastAttributes, nn.Module):
    def __init__(self, cfg: ModelConfig, platform: Platform):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            cfg.hidden_size, {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            row_multiple=platform.row_multiple(),
        )
        self.act = act_and_mul(cfg.hidden_act, platform.kernels)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           row_multiple=platform.row_multiple())
        self.reduce = platform.reduce()  # sums the row-parallel down_proj's partial outputs across ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the projections' own dtype throughout: a packed gate_up answers in bfloat16, which the packed down
        projection takes as it is (no round trip through float32 between them)."""
        out = self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(FastAttributes, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, platform: Platform):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, platform.kernels)
        self.self_attn = Attention(cfg, layer, platform)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, platform.kernels)
        self.mlp = MLP(cfg, platform)

    def forward(self, stream: torch.Tensor, delta: torch.Tensor | None, rope,
                step: AttentionStep) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream with the previous layer's output `delta` added): the
        next layer's norm adds it, so an add and a norm are one pass where the norm is fused."""
        h, stream = self.input_layernorm.add_norm(stream, delta, self.self_attn.qkv_proj.input_dtype)
        attn = self.self_attn.forward(h, rope, step)  # forward itself: no hooks to run, 1 us saved
        h, stream = self.post_attention_layernorm.add_norm(stream, attn, self.mlp.gate_up_proj.input_dtype)
        return self.mlp.forward(h), stream


class LlamaForCausalLM(FastAttributes, nn.Module):
    """Parameter names follow the Hugging Face layout, so checkpoints load by name plus a shard map."""

    # checkpoint name fragment -> (module attribute holding the merged weight, shard)
    PACKED = {
        "q_proj": ("qkv_proj", "q_proj"),
        "k_proj": ("qkv_proj", "k_proj"),
        "v_proj": ("qkv_proj", "v_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, platform: Platform = EAGER):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, platform) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, platform.kernels)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, platform.row_multiple(), platform.kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.requires_grad_(False)
        self.fused = platform.kernels  # the CPU decoder's fused kernels, or None (torch's ops)
        self.vocab_parallel = None if platform.group is None else (platform.group, platform.vocab_start)

    def forward(self, batch: StepBatch, cache: KVCache, read: PagedRead) -> torch.Tensor:
        """Run the step's tokens and return logits for `batch.logits_indices` only (under tensor parallelism,
        for this rank's slice of the vocabulary)."""
        if self.vocab_parallel is None:
            x = self.embed_tokens(batch.input_ids)
        else:
            group, start = self.vocab_parallel
            x = group.embed(self.embed_tokens, batch.input_ids, start)
        rope = self.rope.table(batch.positions, x.dtype)
        fused_read = None if self.fused is None else (self.fused, self.layers[0].self_attn.o_proj.input_dtype)
        step = read.step(batch, cache, fused_read)
        delta = None
        for layer in self.layers:
            delta, x = layer.forward(x, delta, rope, step)
        return self.lm_head.forward(self.norm.add_norm_rows(x, delta, batch.logits_indices))
