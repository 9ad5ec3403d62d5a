"""A merged projection loads only when every shard does: a checkpoint missing one k_proj, up_proj or qkv bias
is refused by name instead of running on uninitialised memory."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.errors import CheckpointError
from nanoserve.model.loader import load_model


def without(checkpoint, tmp_path, *names: str):
    """A copy of the checkpoint whose safetensors file lacks the named tensors."""
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    for name in names:
        del tensors[name]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def load(path):
    return load_model(path, torch.float32, torch.device("cpu"), max_positions=64)


@pytest.mark.parametrize("missing", ["model.layers.1.self_attn.k_proj.weight",
                                     "model.layers.0.mlp.up_proj.weight"])
def test_a_missing_shard_of_a_merged_projection_is_refused_by_name(tiny_checkpoint, tmp_path, missing):
    path = without(tiny_checkpoint("llama"), tmp_path, missing)
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert "lacks 1 weight: " + missing.removeprefix("model.") in str(e.value)
    assert "incomplete" in str(e.value)


def test_a_missing_qkv_bias_shard_is_refused(tiny_checkpoint, tmp_path):
    path = without(tiny_checkpoint("qwen2"), tmp_path, "model.layers.0.self_attn.v_proj.bias")
    with pytest.raises(CheckpointError, match=r"lacks 1 weight: layers\.0\.self_attn\.v_proj\.bias"):
        load(path)


def test_every_missing_shard_is_counted(tiny_checkpoint, tmp_path):
    names = [f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj")]
    with pytest.raises(CheckpointError, match="lacks 6 weights: .* and 1 more"):
        load(without(tiny_checkpoint("llama"), tmp_path, *names))


def test_complete_checkpoints_still_load(tiny_checkpoint):
    for kind in ("llama", "qwen2"):
        loaded = load(tiny_checkpoint(kind))
        qkv = loaded.model.layers[0].self_attn.qkv_proj
        assert torch.isfinite(qkv.weight).all()


def test_a_shard_of_the_wrong_shape_names_the_weight(tiny_checkpoint, tmp_path):
    path = without(tiny_checkpoint("llama"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: .* has shape"):
        load(path)
