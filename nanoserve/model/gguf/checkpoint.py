"""`load_gguf`: a llama GGUF file as HF-named, HF-layout tensors plus its config and tokenizer."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf.config import gguf_architecture, hf_config, longrope_scaling, rope_scaling
from nanoserve.model.gguf.dequant import SUPPORTED_QUANT_TYPES, dequantize
from nanoserve.model.gguf.reader import TensorInfo, parse
from nanoserve.model.gguf.tokenizer import build_tokenizer, special_token
from nanoserve.model.quant import KEPT_GGUF_TYPES, QuantBlocks, from_gguf
from nanoserve.model.quant.blocks import HALF_TYPES, K_QUANT_UNITS

__all__ = ["GGUFCheckpoint", "GGUFHeader", "load_gguf", "read_gguf_header", "read_gguf_weights"]


@dataclass(frozen=True)
class GGUFCheckpoint:
    """Everything a GGUF file holds, in Hugging Face terms.

    The tokenizer adds no special tokens by itself: prepend `bos_token` when `add_bos_token` is set.
    """

    config: dict
    tensors: dict[str, torch.Tensor | QuantBlocks]
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    head_blocks: QuantBlocks | None = None  # the output head's blocks, as the file has them (with keep_blocks)


_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _expected_tensors(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, HF shape) for every tensor a dense model of the config must have: Qwen2's qkv
    biases (attention_bias) and Qwen3's per-head q/k norms included."""
    h, inter, vocab, dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * dim, cfg["num_key_value_heads"] * dim
    shapes = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_norm": (h,), "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}
    layer = {f"{leaf}.weight": (f"{hf}.weight", shapes[leaf]) for leaf, hf in _LAYER_TENSORS.items()}
    if cfg["model_type"] == "phi3":  # q, k, v in one tensor and gate, up in another (split at load: models/phi3.py)
        for leaf in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del layer[f"{leaf}.weight"]
        layer |= {"attn_qkv.weight": ("self_attn.qkv_proj.weight", (q + 2 * kv, h)),
                  "ffn_up.weight": ("mlp.gate_up_proj.weight", (2 * inter, h))}
    if cfg["attention_bias"]:
        layer |= {f"{leaf}.bias": (f"{_LAYER_TENSORS[leaf]}.bias", shapes[leaf][:1]) for leaf in
                  ("attn_q", "attn_k", "attn_v")}
    if cfg["model_type"] == "qwen3":
        layer |= {"attn_q_norm.weight": ("self_attn.q_norm.weight", (dim,)),
                  "attn_k_norm.weight": ("self_attn.k_norm.weight", (dim,))}
    out = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, h)), "output_norm.weight": ("model.norm.weight", (h,))}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (vocab, h))
    for i in range(cfg["num_hidden_layers"]):
        out |= {f"blk.{i}.{leaf}": (f"model.layers.{i}.{hf}", shape) for leaf, (hf, shape) in layer.items()}
    return out


def _undo_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf.py's `permute` of q/k rows (HF's rotate-half layout -> ggml's interleaved
    pairs), exactly as transformers' GGUF loader does."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_raw(f, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes, mapped from the file as llama.cpp does rather than read: blocks kept as they lie cost
    no copy (a private mapping, so nothing written through it reaches the file), and each tensor has its own
    mapping, let go with the last array that holds it (a dequantized tensor's file pages do not stay mapped)."""
    if os.fstat(f.fileno()).st_size < info.offset + info.nbytes:
        raise CheckpointError(f"{f.name} is truncated: tensor {info.name} runs past the end; download it again")
    if info.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_WILLNEED"):
        mapped.madvise(mmap.MADV_WILLNEED)  # read ahead now, not page by page at the first step
    return np.frombuffer(mapped, dtype=np.uint8, count=info.nbytes, offset=info.offset - start)


def _read_tensor(f, info: TensorInfo) -> np.ndarray:
    return dequantize(_read_raw(f, info), info.qtype, info.shape)


def _to_torch(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:  # numpy rounds to half exactly as torch does, without torch's thread pool
        w = w.astype(np.float16)
    t = torch.from_numpy(np.ascontiguousarray(w))
    return t if t.dtype == dtype else t.to(dtype)


def _check_is_file(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist; pass the path of an existing .gguf file")
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a directory, not a GGUF file; pass a .gguf file here (Hugging Face checkpoint "
            "directories load through the safetensors loader)"
        )


def _read_header(path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    """The file's metadata and its tensors by name, refused unless the registry runs its architecture and its
    types are ones we dequantize."""
    meta, info_list = parse(path)
    gguf_architecture(meta, path)
    bad = sorted({i.type_name for i in info_list if i.type_name not in SUPPORTED_QUANT_TYPES})
    if bad:
        raise CheckpointError(
            f"{path} stores tensors as {', '.join(bad)}, which this loader cannot dequantize; supported types: "
            f"{', '.join(SUPPORTED_QUANT_TYPES)}. Use a file quantized to one of those (e.g. Q4_K_M, Q8_0, F16)"
        )
    infos = {i.name: i for i in info_list}
    if "token_embd.weight" not in infos:
        raise CheckpointError(f"{path} has no token_embd.weight tensor; the file is incomplete, download it again")
    return meta, infos


def _check_tensors(path: Path, infos: dict[str, TensorInfo], expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The file holds exactly the tensors the dense model of its config has (rope_freqs aside), in the
    shapes that config implies."""
    missing = sorted(set(expected) - set(infos))
    extra = sorted(set(infos) - set(expected) - ROPE_TENSORS)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors its architecture's model has, e.g. "
                              f"{missing[:3]}; the file is incomplete or not a plain dense model")
    if extra:
        raise CheckpointError(
            f"{path} has tensors its architecture's model does not use, e.g. {extra[:3]} (biases, experts or "
            "extra norms); only the dense models of nanoserve/models/ are supported"
        )
    for name, (_, shape) in expected.items():
        if infos[name].shape != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(infos[name].shape)} but the metadata implies "
                f"{list(shape)}; the file is inconsistent"
            )


ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}  # read as rope_scaling


def _read_rope_scaling(f, meta: dict, infos: dict[str, TensorInfo], config: dict, path: Path) -> dict | None:
    """The config's rope_scaling, from the metadata and the rope_freqs tensor where the file has one, or
    LongRoPE's two factor tensors (Phi-3)."""
    def read(name: str) -> torch.Tensor | None:
        return _to_torch(_read_tensor(f, infos[name]), torch.float32) if name in infos else None

    long, short = read("rope_factors_long.weight"), read("rope_factors_short.weight")
    if long is not None or short is not None:
        return longrope_scaling(meta, long, short, config, path)
    return rope_scaling(meta, read("rope_freqs.weight"), config["head_dim"], config["rope_theta"], path)


def _read_weights(f, infos: dict[str, TensorInfo], expected: dict[str, tuple[str, tuple[int, ...]]], config: dict,
                  dtype: torch.dtype, keep_blocks: bool, cut) -> tuple[dict, QuantBlocks | None]:
    """Every expected tensor under its HF name, q/k rows back in HF's layout and each passed through `cut` as it
    is read: dequantized to `dtype`, or with `keep_blocks` a projection's exact blocks. Also the output head's
    blocks when kept (its dense weight is read as well, for the embedding's lookup, unless they are K-quants: then
    the embedding and head come as blocks alone)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] == "llama"  # llama.cpp's converter permutes q/k rows of llama models only
    tensors: dict[str, torch.Tensor | QuantBlocks] = {}
    head_blocks = None
    head_name = "token_embd.weight" if config["tie_word_embeddings"] else "output.weight"
    cut = cut or (lambda name, t: t)
    for name, (hf_name, _) in expected.items():
        info = infos[name]
        rope_heads = None if not permuted else heads if name.endswith(".attn_q.weight") else kv_heads \
            if name.endswith(".attn_k.weight") else None
        keep = keep_blocks and info.type_name in KEPT_GGUF_TYPES and \
            (len(info.shape) == 2 or info.type_name not in HALF_TYPES)
        if keep and info.type_name in K_QUANT_UNITS and name in ("token_embd.weight", head_name):
            # the embedding and head in K-quants: looked up and multiplied in the file's blocks, no dense copy
            tensors[hf_name] = cut(hf_name, from_gguf(_read_raw(f, info), info.type_name, info.shape))
            head_blocks = tensors[hf_name] if name == head_name else head_blocks
            continue
        if keep and name.startswith("blk."):
            blocks = from_gguf(_read_raw(f, info), info.type_name, info.shape)
            if rope_heads is not None:
                blocks = blocks.rows(_undo_rope_permute(np.arange(info.shape[0]), rope_heads))
            tensors[hf_name] = cut(hf_name, blocks)
            continue
        if keep and name == head_name:
            head_blocks = cut("lm_head.weight", from_gguf(_read_raw(f, info), info.type_name, info.shape))
        w = _read_tensor(f, info)
        if rope_heads is not None:
            w = _undo_rope_permute(w, rope_heads)
        tensors[hf_name] = cut(hf_name, _to_torch(w, dtype))
    return tensors, head_blocks


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file read up to its weights: everything that can refuse it has run."""

    path: Path
    infos: dict[str, TensorInfo]
    expected: dict[str, tuple[str, tuple[int, ...]]]  # GGUF name -> (HF name, shape)
    config: dict  # config.json-shaped, rope_scaling included
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool


def read_gguf_header(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> GGUFHeader:
    """A GGUF file's config and tokenizer, its tensors checked against them, no weight read: what a model is
    built from before its weights are read into it (and each cut to a rank's slice as it comes)."""
    path = Path(path)
    _check_is_file(path)
    meta, infos = _read_header(path)
    config = hf_config(meta, infos, path, dtype)
    expected = _expected_tensors(config)
    _check_tensors(path, infos, expected)
    # Everything that can refuse the file runs before the (comparatively slow) dequantization.
    tokenizer, add_bos = build_tokenizer(meta, path)
    with open(path, "rb") as f:
        config["rope_scaling"] = _read_rope_scaling(f, meta, infos, config, path)
    return GGUFHeader(path, infos, expected, config, tokenizer, meta.get("tokenizer.chat_template"),
                      special_token(meta, "tokenizer.ggml.bos_token_id"),
                      special_token(meta, "tokenizer.ggml.eos_token_id"), add_bos)


def read_gguf_weights(header: GGUFHeader, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
                      cut: Callable | None = None) -> tuple[dict, QuantBlocks | None]:
    """The file's tensors under their HF names and the output head's blocks (see load_gguf). `cut(name, tensor)`
    (tensor parallelism: a rank's slice) is applied to each tensor as it is read, one at a time, so the whole
    model is never held."""
    with open(header.path, "rb") as f:
        return _read_weights(f, header.infos, header.expected, header.config, dtype, keep_blocks, cut)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              keep_blocks: bool = False, cut: Callable | None = None) -> GGUFCheckpoint:
    """Read a GGUF file into HF-named tensors of `dtype` (dequantized), an HF-shaped config dict and a tokenizer.
    Refuses, with a CheckpointError naming the fix, anything it cannot load exactly. With `keep_blocks`, Q4_0 /
    Q4_1 / Q8_0 projection weights come back as their exact blocks (`GgufInt4Rows`, `Int8Blocks`) instead of
    dequantized, and so does the output head (or the embedding it is tied to) as `head_blocks`, beside its dense
    weight (the embedding's lookup needs that). `cut`: see read_gguf_weights."""
    header = read_gguf_header(path, dtype)
    tensors, head_blocks = read_gguf_weights(header, dtype, keep_blocks, cut)
    return GGUFCheckpoint(
        config=header.config,
        tensors=tensors,
        tokenizer=header.tokenizer,
        chat_template=header.chat_template,
        bos_token=header.bos_token,
        eos_token=header.eos_token,
        add_bos_token=header.add_bos_token,
        head_blocks=head_blocks,
    )
