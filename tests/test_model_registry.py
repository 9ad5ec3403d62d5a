"""The model seam: an architecture is found through the registry, and a model is built with what this machine runs
its layers on (nothing is swapped into it afterwards)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.loader import load_model
from nanoserve.models import registry
from nanoserve.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")


def test_every_registered_architecture_resolves_to_its_file_and_class():
    for arch, entry in registry.ARCHITECTURES.items():
        cls = registry.model_class(arch)
        assert cls.__module__ == f"nanoserve.models.{entry.module}" and cls.__name__ == entry.cls
        assert isinstance(cls.PACKED, dict)
    for gguf_arch, arch in registry.GGUF_ARCHITECTURES.items():
        assert arch in registry.ARCHITECTURES, gguf_arch


def _renamed(checkpoint, tmp_path, architecture: str):
    out = tmp_path / "renamed"
    shutil.copytree(checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_an_architecture_is_a_registry_line(tiny_checkpoint, tmp_path, monkeypatch):
    """A name the registry lacks is refused naming what runs; one registry line makes it load, as that class."""
    path = _renamed(tiny_checkpoint("llama"), tmp_path, "SeamTestForCausalLM")
    with pytest.raises(CheckpointError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(path, torch.float32, CPU, max_positions=64)
    monkeypatch.setitem(registry.ARCHITECTURES, "SeamTestForCausalLM", registry.Entry("llama", "LlamaForCausalLM",
                                                                                          "llama"))
    loaded = load_model(path, torch.float32, CPU, max_positions=64)
    assert type(loaded.model) is LlamaForCausalLM and loaded.config.architecture == "SeamTestForCausalLM"
    reference = load_model(tiny_checkpoint("llama"), torch.float32, CPU, max_positions=64)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(),
                                                 reference.model.state_dict().values()))


def _layers_kernels(model) -> set:
    """What the residual norms and the activations were built with (q/k norms run inside the fused rotary)."""
    return {id(m.kernels) if m.kernels is not None else None for name, m in model.named_modules()
            if name == "norm" or name.endswith(("layernorm", ".act"))}


def test_the_fused_kernels_are_chosen_before_the_model_is_built(tiny_checkpoint):
    """A float32 model is built on the kernels (every norm and activation holds them); a bfloat16 one is built
    without, and its status says why; no kernels at all: the reason given is the status's."""
    from nanoserve.model.fused import fused_kernels

    kernels, why = fused_kernels(True, CPU)
    if kernels is None:
        pytest.skip(f"no fused kernels here: {why}")
    path = tiny_checkpoint("qwen3")
    fp32 = load_model(path, torch.float32, CPU, max_positions=64, kernels=kernels, no_kernels=why)
    assert fp32.fused.active and fp32.model.fused is kernels and _layers_kernels(fp32.model) == {id(kernels)}
    bf16 = load_model(path, torch.bfloat16, CPU, max_positions=64, kernels=kernels, no_kernels=why)
    assert not bf16.fused.active and "bfloat16" in bf16.fused.reason
    assert bf16.model.fused is None and _layers_kernels(bf16.model) == {None}
    off = load_model(path, torch.float32, CPU, max_positions=64, no_kernels="--no-fused-cpu-kernels")
    assert not off.fused.active and off.fused.reason == "--no-fused-cpu-kernels"
    assert not any(hasattr(LlamaForCausalLM, name) for name in ("use_fused", "parallelize"))


def test_dense_linears_are_built_with_their_row_multiple(tiny_checkpoint):
    """A batch-invariant model's dense matmuls pad their calls to the multiple measured for their dtype here,
    given as they are built; a model that is not batch-invariant pads nothing."""
    from nanoserve.invariance import linear_row_multiple

    path = tiny_checkpoint("qwen2")
    expected = linear_row_multiple(torch.float32, "cpu") or 1
    for invariant, multiple in ((True, expected), (False, 1)):
        model = load_model(path, torch.float32, CPU, max_positions=64, invariant=invariant).model
        linears = [m for m in model.modules() if hasattr(m, "matmul_dtype")]
        assert len(linears) == 2 * 4 + 1 and {m.row_multiple for m in linears} == {multiple}, invariant


# Megatron's split, written out here as the oracle (not read from the code): what each checkpoint tensor's layer
# must say, so a rank loads the right slice of it
MEGATRON = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column", "up_proj": "column",
            "o_proj": "row", "down_proj": "row", "embed_tokens": "vocab", "lm_head": "vocab"}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_every_checkpoint_tensor_is_split_as_its_layer_says(tiny_checkpoint, kind):
    """Tensor parallelism asks the layer a tensor loads into how it is split (no checkpoint name is matched):
    column for q/k/v and gate/up (biases too), row for o and down, vocab for the embedding and the head, whole
    for every norm."""
    from safetensors import safe_open

    from nanoserve.model.targets import split_of, weight_target

    path = tiny_checkpoint(kind)
    model = load_model(path, torch.float32, CPU, max_positions=64).model
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any("norm" in name for name in names)
    for name in names:
        assert weight_target(model, name) is not None, name
        leaf = next((part for part in name.split(".") if part in MEGATRON), None)
        assert split_of(model, name) == MEGATRON.get(leaf), name


def test_a_quantized_load_keeps_its_layers_and_runs_each_on_its_formats_method(tmp_path):
    """The default model's 4-bit file: every decoder projection stays the layer the model built (nothing
    swapped in), runs the packed module of the linear method for its blocks, and its dense weight is let go."""
    from nanoserve.model.fused import fused_kernels
    from nanoserve.model.linear import LinearLayer, MergedColumnLinear, RowParallelLinear
    from nanoserve.model.quant import Int4Blocks
    from nanoserve.model.quant.methods import method_for

    kernels, why = fused_kernels(True, CPU)
    loaded = load_model(None, torch.float32, CPU, max_positions=64, quantization="auto", kernels=kernels,
                        no_kernels=why)
    expected = method_for(Int4Blocks.quantize(torch.zeros(16, 32)), kernels).format
    for layer in loaded.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn.qkv_proj) is MergedColumnLinear and type(mlp.gate_up_proj) is MergedColumnLinear
        assert type(attn.o_proj) is RowParallelLinear and type(mlp.down_proj) is RowParallelLinear
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert proj.packed is not None and proj.packed.format == expected and proj.weight is None
    assert loaded.quant.formats == {expected: 4 * len(loaded.model.layers)}
    assert not any(isinstance(m, LinearLayer) for m in loaded.model.layers[0].self_attn.qkv_proj.packed.modules())
