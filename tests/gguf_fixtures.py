"""Tiny llama GGUF files written with gguf.GGUFWriter, laid out the way llama.cpp's converter writes them.

The weights are generated in the Hugging Face layout and converted here (names, q/k row permutation,
quantization), so a loader that reads them back must reproduce the originals.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from tests.kquant_encode import ENCODERS, encode_k

TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, context=256, theta=10000.0, eps=1e-5)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
# A small byte-level BPE: each merge joins tokens that exist by then (bytes or earlier merges).
MERGES = [
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "l l", "e ll", "h ell", "hell o", "Ġ h",
    "Ġ hello", "o r", "Ġ w", "Ġw or", "l d", "Ġwor ld", "i s", "Ġ is", "Ġ in", "in g", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ",
    "( )", "d e", "de f", "Ġ def", "Ġ (", "e s", "Ġt es", "Ġtes t",
]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

# A SentencePiece-style vocabulary: <unk>/<s>/</s>, 256 byte-fallback tokens, then scored pieces.
SPM_PIECES = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "a", "n", "i", "s", "g", "he", "▁t", "▁the", "ll",
              "ell", "hell", "hello", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "in", "ing", "▁a", "an", "▁an"]


def gpt2_alphabet() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the small byte-level BPE above."""
    alphabet = gpt2_alphabet()
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + [alphabet[b] for b in range(256)] + merged + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (256 + len(merged)) + [4] * len(USER_DEFINED)
    assert len(set(tokens)) == len(tokens)
    return tokens, types, list(MERGES)


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores): longer pieces score higher, as SentencePiece BPE assigns them."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(SPM_PIECES))][::-1]
    return tokens, types, scores


def hf_weights(vocab: int, seed: int = 0, tie: bool = False, **cfg) -> dict[str, np.ndarray]:
    """Random float32 weights in the Hugging Face llama layout and naming."""
    c = dict(TINY, **cfg)
    h, inter, hd = c["hidden"], c["intermediate"], c["hidden"] // c["heads"]
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": 1 + w(h)}
    if not tie:
        out["lm_head.weight"] = w(vocab, h)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(c["heads"] * hd, h),
            p + "self_attn.k_proj.weight": w(c["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": w(c["kv_heads"] * hd, h),
            p + "self_attn.o_proj.weight": w(h, c["heads"] * hd),
            p + "post_attention_layernorm.weight": 1 + w(h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    return out


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused tensors, as llama.cpp names them
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"


def encode(arr: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(array to write, raw ggml type or None) for one tensor stored as `qtype`."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ENCODERS:  # the K-quants: gguf decodes them but cannot write them
        return encode_k(arr, qtype), t
    if qtype == "F32":
        return arr, None
    if qtype == "F16":
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, t), t


def reference(arr: np.ndarray, qtype: str) -> np.ndarray:
    """What a faithful loader must return for `arr` stored as `qtype`: gguf's own round trip."""
    data, raw = encode(arr, qtype)
    return gguf.quants.dequantize(data, raw or gguf.GGMLQuantizationType[qtype]).reshape(arr.shape)


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3 (its python loop, kept as written)."""
    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = context / low, context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    qtype: str = "F32",
    arch: str = "llama",
    tokenizer: str = "gpt2",
    pre: str = "smollm",
    add_bos: bool | None = False,
    rope_freqs: np.ndarray | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
    extra_kv: dict | None = None,
    tensor_types: dict[str, str] | None = None,
    **cfg,
) -> Path:
    """Write `weights` (HF layout) as a llama.cpp-style GGUF: q/k rows permuted, 2-D tensors as `qtype` (or as
    `tensor_types` names for an HF name ending in one of its keys: a mixed file such as Q4_K_M), norms as F32 (llama.cpp
    never quantizes 1-D tensors)."""
    c = dict(TINY, **cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_block_count(c["layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["intermediate"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    if not c.get("head_dim"):
        w.add_rope_dimension_count(c["hidden"] // c["heads"])
    w.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    elif tokenizer == "llama":
        tokens, types, scores = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    elif tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(["a", "b"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, value)

    if c.get("original_context"):  # LongRoPE's original context (Phi-3)
        w.add_rope_scaling_orig_ctx_len(c["original_context"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_rope_dimension_count(c["head_dim"])
    for name, arr in weights.items():
        if arch != "llama":  # llama.cpp's converter permutes the q/k rows of llama models only
            pass
        elif name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, c["heads"], c["heads"])
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, c["heads"], c["kv_heads"])
        kind = next((t for end, t in (tensor_types or {}).items() if name.endswith(end)), qtype)
        data, raw = encode(arr, kind) if arr.ndim == 2 else (arr, None)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    for name, (data, raw) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
