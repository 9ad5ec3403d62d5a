"""Config fields that change what a model computes are honoured or refused at load, never dropped: a checkpoint
whose `hidden_act` is SiLU or GELU (exact or tanh) computes it, as transformers does on the same weights, and
any other is refused naming it; a `sliding_window` shorter than the context caps
max_model_len at the window (where attending to every earlier token is the window's attention) and refuses a
longer one; Qwen's window counts only with `use_sliding_window`."""

from __future__ import annotations

import pytest

from nanoserve import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import CheckpointError, ConfigError
from nanoserve.model.config import NOT_THE_MATH, READ, REFUSED_UNLESS, ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.mark.parametrize("family", ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "Phi3Config"])
def test_every_field_of_transformers_config_classes_is_read_or_said_to_change_nothing(family):
    """A field transformers adds to a supported family's config fails here until model/config.py places it."""
    fields = set(getattr(pytest.importorskip("transformers"), family)().to_dict())
    unplaced = sorted(fields - READ - NOT_THE_MATH - set(REFUSED_UNLESS))
    assert not unplaced, f"{family} fields nanoserve neither reads nor refuses: {unplaced}"


def test_an_mlp_with_biases_is_refused():
    with pytest.raises(CheckpointError, match="mlp_bias=True"):
        ModelConfig.from_hf({**BASE, "mlp_bias": True})
    assert ModelConfig.from_hf({**BASE, "mlp_bias": False}).hidden_size == 64


@pytest.mark.parametrize("act", ["relu", "gelu_fast", "silu_and_more"])
def test_an_activation_the_mlp_does_not_compute_is_refused_by_name(act):
    with pytest.raises(CheckpointError, match=f"hidden_act '{act}'"):
        ModelConfig.from_hf({**BASE, "hidden_act": act})
    assert ModelConfig.from_hf({**BASE, "hidden_act": "silu"}).hidden_act == "silu"
    assert ModelConfig.from_hf(BASE).hidden_act == "silu"  # transformers' default for these families


def test_qwen_carries_a_window_it_uses_only_when_asked():
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf(qwen).sliding_window is None
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).sliding_window == 64
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf(mistral).sliding_window == 64
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).sliding_window is None
    layered = {**qwen, "layer_types": ["full_attention", "sliding_attention"]}  # transformers 5's form
    assert ModelConfig.from_hf(layered).sliding_window == 64


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_a_gelu_mlp_computes_transformers_logits(tiny_checkpoint, act):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from nanoserve import LLM, SamplingParams

    path = str(tiny_checkpoint("llama", hidden_act=act))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = LLM(model=path, max_model_len=64, kv_cache_gib=0.01)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    got = [e[t].logprob for e, t in zip(out[0].prompt_logprobs[1:], prompt[1:])]
    ref = [want[i, t].item() for i, t in enumerate(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3


def test_a_real_checkpoint_with_another_activation_does_not_load(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="hidden_act 'relu'"):
        Engine(EngineConfig(model=str(tiny_checkpoint("llama", hidden_act="relu")), max_model_len=64,
                            kv_cache_gib=0.01))


def test_a_sliding_window_caps_the_context_and_refuses_a_longer_one(tiny_checkpoint):
    path = str(tiny_checkpoint("mistral", sliding_window=48))
    engine = Engine(EngineConfig(model=path, kv_cache_gib=0.01))
    assert engine.max_model_len == 48
    with pytest.raises(ConfigError, match="sliding_window of 48"):
        Engine(EngineConfig(model=path, max_model_len=64, kv_cache_gib=0.01))
    assert Engine(EngineConfig(model=path, max_model_len=32, kv_cache_gib=0.01)).max_model_len == 32


def test_a_partial_rotary_embedding_is_refused_by_name():
    """Phi-4-mini rotates three quarters of each head: refused at load, not run as a full rotation."""
    phi = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    assert ModelConfig.from_hf(phi).architecture == "Phi3ForCausalLM"
    for field in ({"partial_rotary_factor": 0.75}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.75}}):
        with pytest.raises(CheckpointError, match="partial_rotary_factor=0.75"):
            ModelConfig.from_hf({**phi, **field})


def test_a_fused_projection_of_the_wrong_size_is_refused_naming_its_parts(tiny_checkpoint, tmp_path):
    """Phi-3's qkv_proj split by the config's sizes: a tensor of other rows names what the config implies."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nanoserve import LLM

    path = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint("phi3"), path)
    weights = load_file(path / "model.safetensors")
    key = "model.layers.0.self_attn.qkv_proj.weight"
    weights[key] = weights[key][:-8].contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight has 120 rows .*\(q_proj 64 \+ k_proj 32 \+ v_proj 32\)"):
        LLM(model=str(path), max_model_len=64, kv_cache_gib=0.01)
