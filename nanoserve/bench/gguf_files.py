"""Random-weight GGUF files of real model shapes, quantized by llama.cpp's own quantizer.

Speed does not depend on the weights' values, so a file of Llama-3.2-1B's shape with random weights, quantized to
Q4_K_M by llama.cpp, costs a step what the real file costs. The tokenizer (and so the vocabulary, 49,152 tokens)
is the default model's, copied from its GGUF file; the shapes are otherwise the real models'.

The F16 source is written one tensor at a time (never the whole model in memory), then quantized with
`llama_model_quantize` (llama-cpp-python, the `peers` extra), as `llama-quantize` would.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from nanoserve.optional import require

# name -> (hidden, layers, heads, kv heads, intermediate, tied embeddings, rope theta)
SHAPES = {
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, True, 500000.0),
    "llama-3.2-3b": (3072, 28, 24, 8, 8192, True, 500000.0),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, False, 500000.0),
    "smoke": (256, 2, 4, 2, 512, True, 10000.0),  # seconds to write and quantize: the tests' shape
}

CONTEXT = 8192  # the context length the files declare (the real ones declare 131,072; nothing here reads further)


def _tokenizer_fields(writer, default_gguf: Path) -> int:
    """Copy every tokenizer.* key of the default model's file into `writer`; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(default_gguf))
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, value)
            vocab = len(value) if key == "tokenizer.ggml.tokens" else vocab
        else:
            writer.add_key_value(key, value, field.types[0])
    return vocab


def _tensors(shape: tuple, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a llama file of `shape`, by GGUF name and (rows, columns) shape, in file order."""
    hidden, layers, heads, kv_heads, inter, tied, _ = shape
    dim = hidden // heads
    out = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_q.weight", (heads * dim, hidden)),
                (f"blk.{i}.attn_k.weight", (kv_heads * dim, hidden)),
                (f"blk.{i}.attn_v.weight", (kv_heads * dim, hidden)),
                (f"blk.{i}.attn_output.weight", (hidden, heads * dim)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
                (f"blk.{i}.ffn_gate.weight", (inter, hidden)), (f"blk.{i}.ffn_up.weight", (inter, hidden)),
                (f"blk.{i}.ffn_down.weight", (hidden, inter))]
    out.append(("output_norm.weight", (hidden,)))
    if not tied:
        out.append(("output.weight", (vocab, hidden)))
    return out


def write_random_gguf(path: Path, name: str, seed: int = 0) -> Path:
    """An F16 llama GGUF file of SHAPES[name] with random weights (N(0, 0.02); norms 1, in F32 as llama.cpp keeps
    them), the default model's tokenizer, written one tensor at a time."""
    require("gguf", "writing a GGUF file")
    import gguf

    from nanoserve.model.loader import default_model_path

    shape = SHAPES[name]
    hidden, layers, heads, kv_heads, inter, _, theta = shape
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {name}")
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _tokenizer_fields(writer, default_model_path())
    writer.add_vocab_size(vocab)
    tensors = _tensors(shape, vocab)
    for tensor, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(tensor, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
    writer.close()
    return path


def quantize(source: Path, out: Path, type_name: str, threads: int) -> Path:
    """`source` quantized to `type_name` ("Q4_0", "Q4_K_M", ...: llama.cpp's LLAMA_FTYPE_MOSTLY_* names) by
    llama.cpp's own quantizer, as `llama-quantize source out TYPE` writes it (its choice of types per tensor:
    Q4_K_M puts some in Q6_K, and the embedding of every 4-bit file in Q6_K)."""
    require("llama_cpp", "quantizing with llama.cpp's quantizer")
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}", None)
    if ftype is None:
        known = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp)
                       if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"llama.cpp has no quantization type {type_name!r}; one of {', '.join(known)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {type_name}")
    return out
