"""ModelConfig: the few numbers the decoder needs, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import CheckpointError
from nanoserve.model.layers import ACTIVATIONS
from nanoserve.models.registry import ARCHITECTURES

_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    hidden_act: str = "silu"  # the MLP's gate activation (nanoserve.model.layers.ACTIVATIONS)
    sliding_window: int | None = None  # attention reaches this many tokens back (None: every earlier token)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read an HF config.json dict, refusing architectures the decoder does not implement."""
        archs = cfg.get("architectures") or [_BY_MODEL_TYPE.get(cfg.get("model_type"), "")]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; nanoserve runs "
                f"{', '.join(ARCHITECTURES)} checkpoints and llama-architecture GGUF files"
            )
        family = ARCHITECTURES[arch].family  # how its config is read (nanoserve/models/registry.py)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(cfg)),
                rope_scaling=_resolved(_rope_scaling(cfg), int(cfg.get("max_position_embeddings", 2048)),
                                       cfg.get("original_max_position_embeddings")),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                hidden_act=str(cfg.get("hidden_act") or "silu"),
                sliding_window=_sliding_window(cfg, family),
            )
        except KeyError as e:
            raise CheckpointError(
                f"config.json lacks {e.args[0]!r}, which a {arch} config must have; "
                "re-export the checkpoint with transformers' save_pretrained"
            ) from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a bad value ({e}); fix the file") from None
        _check_full_rotary(cfg)
        for name, (computed, why) in REFUSED_UNLESS.items():
            if cfg.get(name) not in computed:
                raise CheckpointError(f"config {name}={cfg.get(name)!r} is not implemented: {why}; nanoserve runs "
                                      f"checkpoints with {name} {computed[-1]!r}")
        config.check()
        return config

    def check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}; the config is inconsistent"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.hidden_act not in ACTIVATIONS:
            raise CheckpointError(
                f"hidden_act {self.hidden_act!r} is not implemented: nanoserve's MLP computes act(gate) * up with "
                f"act one of {', '.join(ACTIVATIONS)}, so this checkpoint would compute something else")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise CheckpointError(f"config sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type")
            if kind == "dynamic":
                raise CheckpointError(
                    "rope_scaling type 'dynamic' is not implemented: its frequencies change with the sequence's "
                    "length, so a token's numbers would depend on how long its sequence had grown (prefill and "
                    "decode would disagree); nanoserve runs llama3, linear, yarn, longrope and default rope")
            if kind not in ROPE_KINDS:
                raise CheckpointError(
                    f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}"
                )


ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")
# Every field of the supported families' transformers configs is one of three kinds (tests/test_model_config_fields.py
# walks transformers' config classes against them, so a field a new transformers adds fails until it is placed).
READ = frozenset({  # what ModelConfig reads (and check() holds to what the decoder computes)
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "hidden_act",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "torch_dtype", "dtype",
    "original_max_position_embeddings", "partial_rotary_factor"})
NOT_THE_MATH = frozenset({  # the tokenizer's ids, training, and transformers' own output switches
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "initializer_range", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "_name_or_path", "transformers_version",
    "pretraining_tp",  # pretraining_tp > 1 slices the same matmuls in transformers: the same function
    "resid_pdrop", "embd_pdrop"})  # Phi-3's dropouts: training only
REFUSED_UNLESS = {  # field -> (values the decoder computes, what any other value would ask for)
    "mlp_bias": ((None, False), "the MLP's projections have biases, which nanoserve's MLP does not add"),
}


def _sliding_window(cfg: dict, family: str) -> int | None:
    """The attention window the checkpoint asks for: Mistral's `sliding_window` whenever set; Qwen2/Qwen3 carry one
    too but use it only with `use_sliding_window` (and then in layers from `max_window_layers` on)."""
    window = cfg.get("sliding_window")
    layered = "sliding_attention" in (cfg.get("layer_types") or ())  # transformers 5 names each layer's kind
    if window is None or (family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False) and not layered):
        return None
    return int(window)


def _check_full_rotary(cfg: dict) -> None:
    """Rotary embedding over every dimension of a head: a partial one (Phi-4-mini's 0.75) is refused by name."""
    factor = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise CheckpointError(f"config partial_rotary_factor={factor!r} is not implemented: nanoserve rotates every "
                              "dimension of a head; this checkpoint rotates only part of them")


def _resolved(scaling: dict | None, max_positions: int, original: int | None = None) -> dict | None:
    """YaRN and LongRoPE as transformers fills them in: the original context defaults to the config's own
    `original_max_position_embeddings` (Phi-3 keeps it beside rope_scaling), else the model's, and the factor to
    how far the model's context reaches past it."""
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) not in ("yarn", "longrope"):
        return scaling
    original = scaling.get("original_max_position_embeddings") or original or max_positions
    factor = scaling.get("factor") or max_positions / original
    return {**scaling, "original_max_position_embeddings": original, "factor": factor}


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        params = cfg.get("rope_parameters")
        if params and params.get("rope_type", "default") != "default":
            scaling = params
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "default":
        return None
    return scaling
