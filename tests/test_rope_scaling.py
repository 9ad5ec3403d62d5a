"""Each rope scaling the families use, against transformers' own rope on the same config: the rotation table
(cos and sin with their attention factor) position by position, and a whole tiny checkpoint's logits; a scaling
whose angles would depend on the sequence's length is refused by name."""

from __future__ import annotations

import pytest
import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import RotaryEmbedding

transformers = pytest.importorskip("transformers")

HEAD_DIM, THETA, MAX_POS = 64, 10000.0, 256
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + i / 64 for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + i / 16 for i in range(HEAD_DIM // 2)]},
}


def _hf_config(scaling: dict):
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, num_key_value_heads=2,
                                    head_dim=HEAD_DIM, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                                    max_position_embeddings=MAX_POS,
                                    rope_parameters={"rope_theta": THETA, **scaling})


def _ours(scaling: dict) -> RotaryEmbedding:
    cfg = _hf_config(scaling).to_dict()
    config = ModelConfig.from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
    return RotaryEmbedding(HEAD_DIM, MAX_POS, config.rope_theta, config.rope_scaling)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_the_rotation_table_is_transformers(name):
    """cos and (unsigned) sin at every position: transformers' rope at a sequence of that position's length
    (LongRoPE switches its factors on that length; nanoserve on the position, which agrees there)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(_hf_config(SCALINGS[name]))
    ours = _ours(SCALINGS[name])
    for length in (1, 63, 64, 65, MAX_POS):
        positions = torch.arange(length)[None]
        cos, sin = rope(torch.zeros(1, length, HEAD_DIM), positions)
        at = length - 1  # the last position of a sequence this long
        theirs_sin = sin[0, at].clone()
        theirs_sin[: HEAD_DIM // 2].neg_()  # ours folds the rotation's sign into the first half
        torch.testing.assert_close(ours.cos[at], cos[0, at], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[at], theirs_sin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["yarn", "longrope"])
def test_a_checkpoint_with_the_scaling_gives_transformers_logits(tiny_checkpoint, name):
    from nanoserve import LLM, SamplingParams

    scaling = SCALINGS[name]
    ckpt = tiny_checkpoint("llama", max_position_embeddings=MAX_POS, head_dim=HEAD_DIM, num_attention_heads=2,
                           num_key_value_heads=2, hidden_size=HEAD_DIM * 2,
                           rope_parameters={"rope_theta": THETA, **scaling})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    prompt = list(range(5, 50))  # within the original context: longrope's short factors on both sides
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    llm = LLM(model=str(ckpt), max_model_len=MAX_POS, kv_cache_gib=0.01)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    entry = out[0].outputs[0].logprobs[0]
    for token, logprob in entry.items():
        assert abs(logprob.logprob - want[token].item()) < 1e-3, (token, logprob.logprob, want[token].item())
    assert out[0].outputs[0].token_ids[0] == int(want.argmax())


def test_a_scaling_that_depends_on_the_sequences_length_is_refused():
    cfg = {**_hf_config({"rope_type": "linear", "factor": 2.0}).to_dict(), "architectures": ["LlamaForCausalLM"],
           "rope_parameters": {"rope_theta": THETA, "rope_type": "dynamic", "factor": 2.0}, "rope_scaling": None}
    with pytest.raises(CheckpointError, match="'dynamic' is not implemented"):
        ModelConfig.from_hf(cfg)
