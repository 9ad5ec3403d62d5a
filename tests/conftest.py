"""Shared fixtures: tiny random checkpoints written with transformers' save_pretrained, and the default model."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import TINY_SERVE, tiny_server_running

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


# Set by scripts/gpu-check.sh on the lent GPU machine, where the default model cannot travel; anywhere else a
# missing default model is the install's error, and the tests that need it fail rather than skip.
NO_DEFAULT_MODEL = os.environ.get("NANOSERVE_NO_DEFAULT_MODEL") == "1"


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    no_model = pytest.mark.skip(reason="the default model is not on this machine (NANOSERVE_NO_DEFAULT_MODEL=1)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "default_model" in item.keywords and NO_DEFAULT_MODEL:
            item.add_marker(no_model)


@pytest.fixture(scope="session")
def runtime_modules() -> list[str]:
    """The top-level modules the quick-start install brings (runtime dependencies, no extras); see
    tests/without_optional.py, which runs nanoserve with every other package hidden."""
    from tests.without_optional import runtime_modules

    return sorted(runtime_modules())


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A real Hugging Face tokenizer directory (SmolLM2's, exported by transformers from the default GGUF, or
    the copy NANOSERVE_TEST_TOKENIZER names where the default model is not)."""
    from tests.tokenizer_source import carried_tokenizer, export_default_tokenizer

    return carried_tokenizer() or export_default_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write_tiny(kind: str, out, tokenizer_dir, **overrides):
    import shutil

    import transformers

    shard = overrides.pop("_shard", "2GB")
    dtype = getattr(torch, overrides.pop("_dtype", "float32"))  # the checkpoint's stored dtype
    torch.manual_seed(0)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[kind]
    params = dict(TINY, vocab_size=49152, bos_token_id=1, eos_token_id=2, **overrides)
    if kind == "qwen3":
        params.setdefault("head_dim", 32)
    cfg = cls_cfg(**params)
    model = cls_model(cfg).to(torch.float32).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits differ in more than the last ulp
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.to(dtype).save_pretrained(out, max_shard_size=shard)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, hf_tokenizer_dir):
    """Factory: tiny_checkpoint('llama' | 'mistral' | 'qwen2' | 'qwen3' | 'phi3', **config overrides) -> directory
    (`_shard`: safetensors' max shard size; `_dtype`: the stored dtype, float32 unless named)."""
    made = {}

    def make(kind: str = "llama", **overrides):
        key = (kind, repr(sorted(overrides.items(), key=str)))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{kind}")
            made[key] = _write_tiny(kind, out, hf_tokenizer_dir, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def kernels():
    """The fused CPU library (built for this machine), or the test skipped where it cannot be built."""
    from nanoserve.kernels.fused import load

    kernels, why = load()
    if kernels is None:
        pytest.skip(f"the fused kernels cannot run here: {why}")
    return kernels


@pytest.fixture(scope="session")
def default_llm():
    """The embedded default model as users run it (4-bit linears where the machine has the kernel), loaded once
    for the tests that need real text."""
    from nanoserve import LLM

    return LLM(max_model_len=2048, kv_cache_gib=0.25)


@pytest.fixture(scope="session")
def default_llm_dense():
    """The default model on dense float32 weights: the path that equals transformers exactly."""
    from nanoserve import LLM

    return LLM(max_model_len=2048, kv_cache_gib=0.25, quantization="none")




@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoint):
    """A live server on loopback over the tiny llama checkpoint, served as "tiny" (one per test module)."""
    with tiny_server_running(tiny_checkpoint("llama")) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_offline(tiny_checkpoint):
    """The same engine configuration as tiny_server, offline: the oracle for what the server answers."""
    from nanoserve import LLM

    return LLM(model=str(tiny_checkpoint("llama")), **TINY_SERVE)
