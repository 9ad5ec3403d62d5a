"""GGUF loading checked against independent oracles: transformers' own GGUF loader and tokenizer
conversion, gguf's reference (de)quantization, and llama.cpp's converter formulas."""

from __future__ import annotations

import functools
from unittest import mock

import gguf
import numpy as np
import pytest
import torch

from nanoserve.errors import CheckpointError
from nanoserve.model.gguf import SUPPORTED_QUANT_TYPES, dequantize, load_gguf
from tests.gguf_fixtures import (
    CHAT_TEMPLATE,
    TINY,
    byte_level_vocab,
    hf_weights,
    llama3_rope_freqs,
    reference,
    spm_vocab,
    write_llama_gguf,
)

TRICKY = [
    "Hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\n and \u00a0nbsp",
    "emoji 🦙🔥 and a family 👨‍👩‍👧 with ZWJ",
    "中文字符和日本語のテキスト, 한국어",
    "numbers 1234567890 3.14159 -42 1e10 ²³",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé àccents, Ελληνικά, русский, עברית, العربية",
    "don't won't I'm they're we've you'll he'd",
    "",
    " ",
    "\n",
    "a" * 50,
    "<think>reasoning</think>",
]


def _weights_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].shape == t.shape, name
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], t.float()), name


def _transformers_gguf(path, our_config: dict) -> dict:
    """transformers' own GGUF parsing (config dict and dequantized, un-permuted tensors).

    from_pretrained(gguf_file=...) needs accelerate, so this calls the loader it wraps. The model given is
    only used for transformers' GGUF->HF name map; shapes and permutation come from the file.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = {k: v for k, v in our_config.items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    # transformers rebuilds the same (pure) name table once per submodule; caching it saves ~10 s.
    cached = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "get_tensor_name_map", cached):
        return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)


# ---------------------------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct Q4_1) against transformers
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_path():
    from nanoserve.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def default_ckpt(default_path):
    return load_gguf(default_path)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_tokenizer_dir):
    """transformers' conversion of the default GGUF's tokenizer (conftest builds and saves it once)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer_dir)


@pytest.mark.slow
def test_default_model_matches_transformers(default_path, default_ckpt):
    parsed = _transformers_gguf(default_path, default_ckpt.config)
    _weights_equal(default_ckpt.tensors, parsed["tensors"])
    assert "lm_head.weight" not in default_ckpt.tensors and default_ckpt.config["tie_word_embeddings"]

    theirs = parsed["config"]
    ours = default_ckpt.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == theirs[key], key
    assert ours["model_type"] == theirs["model_type"] == "llama"
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["rope_scaling"] is None
    assert ours["torch_dtype"] == "float32"


@pytest.mark.slow
def test_default_tokenizer_matches_transformers(default_ckpt, hf_tokenizer):
    ours = default_ckpt.tokenizer
    assert ours.get_vocab_size() == hf_tokenizer.backend_tokenizer.get_vocab_size()
    for text in TRICKY:
        expected = hf_tokenizer(text, add_special_tokens=False).input_ids
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == expected, text
        assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        # add_bos_token tells the caller what transformers' tokenizer adds around the text.
        bos = [hf_tokenizer.convert_tokens_to_ids(default_ckpt.bos_token)] if default_ckpt.add_bos_token else []
        assert hf_tokenizer(text).input_ids == bos + ids, text
    assert "<|im_start|>" in [t.content for t in ours.get_added_tokens_decoder().values() if t.special]


@pytest.mark.slow
def test_default_special_tokens_and_template(default_ckpt, hf_tokenizer):
    assert default_ckpt.chat_template == hf_tokenizer.chat_template
    assert default_ckpt.bos_token == hf_tokenizer.bos_token == "<|im_start|>"
    assert default_ckpt.eos_token == hf_tokenizer.eos_token == "<|im_end|>"
    assert default_ckpt.add_bos_token is False  # the file says so (tokenizer.ggml.add_bos_token)


# ---------------------------------------------------------------------------------------------
# Tiny synthetic files
# ---------------------------------------------------------------------------------------------

VOCAB = len(byte_level_vocab()[0])
WRITABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Worst-case error of each format on values of magnitude <~0.5, relative to the block's range.
TOLERANCE = {"F32": 0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 4e-3, "Q5_0": 3e-2, "Q5_1": 2e-2, "Q4_0": 6e-2, "Q4_1": 4e-2}


@pytest.fixture(scope="module")
def weights():
    return hf_weights(VOCAB)


@pytest.mark.parametrize("qtype", WRITABLE)
def test_quantized_tensors_match_gguf_reference(tmp_path, weights, qtype):
    path = write_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", weights, qtype=qtype)
    ckpt = load_gguf(path)
    assert sorted(ckpt.tensors) == sorted(weights)
    for name, original in weights.items():
        ours = ckpt.tensors[name]
        expected = reference(original, qtype) if original.ndim == 2 else original
        # Bit-identical to gguf's dequantization; q/k un-permuted back to the HF layout.
        assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected))), name
        assert torch.allclose(ours, torch.from_numpy(original), atol=TOLERANCE[qtype], rtol=0), name


def test_tiny_file_matches_transformers(tmp_path, weights):
    """Untied head and kv_heads != heads, so both the q and the k un-permutation are exercised."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", weights, qtype="Q8_0")
    ckpt = load_gguf(path)
    parsed = _transformers_gguf(path, ckpt.config)
    _weights_equal(ckpt.tensors, parsed["tensors"])
    assert ckpt.config["tie_word_embeddings"] is False and "lm_head.weight" in ckpt.tensors
    assert ckpt.config["num_key_value_heads"] == TINY["kv_heads"] == parsed["config"]["num_key_value_heads"]


def test_rope_permutation_round_trips(tmp_path, weights):
    from gguf import GGUFReader

    path = write_llama_gguf(tmp_path / "f32.gguf", weights, qtype="F32")
    ckpt = load_gguf(path)
    stored = {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors}
    for i in range(TINY["layers"]):
        for proj in ("q", "k"):
            original = weights[f"model.layers.{i}.self_attn.{proj}_proj.weight"]
            assert not np.array_equal(stored[f"blk.{i}.attn_{proj}.weight"], original)  # really permuted on disk
            assert torch.equal(ckpt.tensors[f"model.layers.{i}.self_attn.{proj}_proj.weight"], torch.from_numpy(original))
        v = f"model.layers.{i}.self_attn.v_proj.weight"
        assert torch.equal(ckpt.tensors[v], torch.from_numpy(weights[v]))


@pytest.mark.parametrize("qtype", SUPPORTED_QUANT_TYPES)
def test_dequantize_matches_gguf_on_arbitrary_bytes(qtype):
    """Every supported type, on random bytes (all nibble values, odd scales, NaN/inf included)."""
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rows, cols = 3, 256 * max(1, block // 256) * 2
    raw = np.random.default_rng(1).integers(0, 256, rows * cols // block * size, dtype=np.uint8)
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw.reshape(rows, -1), t).reshape(rows, cols)
        ours = dequantize(raw.copy(), t, (rows, cols))
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    np.testing.assert_array_equal(ours, expected)  # NaN compares equal to NaN here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_in_requested_dtype(tmp_path, weights, dtype):
    ckpt = load_gguf(write_llama_gguf(tmp_path / "t.gguf", weights, qtype="Q8_0"), dtype=dtype)
    assert ckpt.config["torch_dtype"] == str(dtype).removeprefix("torch.")
    for name, original in weights.items():
        expected = reference(original, "Q8_0") if original.ndim == 2 else original
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(np.ascontiguousarray(expected)).to(dtype)), name


def test_tiny_config_and_tokenizer_metadata(tmp_path, weights):
    ckpt = load_gguf(write_llama_gguf(tmp_path / "t.gguf", weights, qtype="F16"))
    c = ckpt.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 128, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
    assert c["vocab_size"] == VOCAB and c["max_position_embeddings"] == 256
    assert c["rope_theta"] == 10000.0 and c["rope_scaling"] is None
    assert c["bos_token_id"] == 1 and c["eos_token_id"] == 2
    assert ckpt.bos_token == "<|im_start|>" and ckpt.eos_token == "<|im_end|>"
    assert ckpt.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "qwen2"])
def test_tiny_byte_level_tokenizer_matches_transformers(tmp_path, weights, pre):
    from transformers import AutoTokenizer

    path = write_llama_gguf(tmp_path / "tok.gguf", weights, pre=pre, add_bos=None)
    ckpt = load_gguf(path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    if pre == "llama-bpe":
        # Llama 3's tokenizer.json (and llama.cpp) set ignore_merges; transformers' GGUF conversion omits it.
        hf.backend_tokenizer.model.ignore_merges = True
    for text in TRICKY + ["hello world the test", " hello  world\n\nis  testing ()"]:
        ids = ckpt.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == hf(text, add_special_tokens=False).input_ids, (pre, text)
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids), (pre, text)
    assert ckpt.tokenizer.encode("<think>").ids == [VOCAB - 1]  # user-defined tokens stay whole
    # llama.cpp adds BOS by default for the Llama 3 pre-tokenizer family only.
    assert ckpt.add_bos_token is (pre == "llama-bpe")


def test_llama3_pretokenizer_takes_whole_words(tmp_path, weights):
    """llama.cpp (and Llama 3's tokenizer.json) use a word that is a token as is, before any merge."""
    path = write_llama_gguf(tmp_path / "l3.gguf", weights, pre="llama-bpe")
    vocab = byte_level_vocab()[0]
    assert load_gguf(path).tokenizer.encode(" hello").ids == [vocab.index("Ġhello")]


def test_unknown_pretokenizer_warns(tmp_path, weights):
    path = write_llama_gguf(tmp_path / "ds.gguf", weights, pre="deepseek-llm")
    with pytest.warns(UserWarning, match="deepseek-llm"):
        load_gguf(path)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    vocab = len(spm_vocab()[0])
    path = write_llama_gguf(tmp_path / "spm.gguf", hf_weights(vocab), tokenizer="llama", add_bos=None)
    ckpt = load_gguf(path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TRICKY + ["hello world the", " hello", "zzz"]:
        ids = ckpt.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
        assert hf(text).input_ids == [1] + ids, text
    assert ckpt.add_bos_token is True and ckpt.bos_token == "<s>" and ckpt.eos_token == "</s>"


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, TINY["hidden"] // TINY["heads"]
    freqs = llama3_rope_freqs(head_dim, theta, factor=32.0, low=1.0, high=4.0, context=8192)
    assert ((freqs > 1) & (freqs < 32)).any()  # the smooth region is exercised
    path = write_llama_gguf(tmp_path / "l3.gguf", hf_weights(VOCAB), rope_freqs=freqs, theta=theta)
    ckpt = load_gguf(path)
    scaling = ckpt.config["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    # transformers' llama3 inverse frequencies == llama.cpp's base frequencies divided by rope_freqs.
    cfg = {k: v for k, v in ckpt.config.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    hf_cfg = LlamaConfig(**cfg, rope_parameters=dict(scaling, rope_theta=theta))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(inv_freq, base / torch.from_numpy(freqs), rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in ckpt.tensors


def test_linear_rope_scaling_from_metadata(tmp_path, weights):
    path = write_llama_gguf(tmp_path / "lin.gguf", weights,
                            extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert load_gguf(path).config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# ---------------------------------------------------------------------------------------------
# Refusals: each names the problem and what to do instead
# ---------------------------------------------------------------------------------------------

def _refused(path, *needles):
    with pytest.raises(CheckpointError) as e:
        load_gguf(path)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_refuses_missing_file(tmp_path):
    _refused(tmp_path / "nope.gguf", "nope.gguf", "does not exist")


def test_refuses_directory(tmp_path):
    _refused(tmp_path, "directory", ".gguf", "safetensors")


def test_refuses_non_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text('{"not": "a gguf"}')
    _refused(p, "not a GGUF file", ".gguf", "checkpoint directory")


def test_refuses_truncated_file(tmp_path, weights):
    p = write_llama_gguf(tmp_path / "t.gguf", weights)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    _refused(p, "truncated", "again")
    p.write_bytes(p.read_bytes()[:2000])
    _refused(p, "truncated", "again")


def test_refuses_other_architecture(tmp_path, weights):
    p = write_llama_gguf(tmp_path / "g.gguf", weights, arch="gemma2")
    _refused(p, "'gemma2'", "'llama', 'qwen2', 'qwen3'", "Qwen3", "Mistral", "directory")


def test_refuses_unsupported_quant_type(tmp_path, weights):
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # a dot-product intermediate, never a weight format
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[q8_1][1] * 2), dtype=np.uint8)
    p = write_llama_gguf(tmp_path / "q81.gguf", weights,
                         extra_tensors={"blk.0.attn_q.weight.extra": (raw, q8_1)})
    _refused(p, "Q8_1", "supported types", "Q4_0", "Q4_1", "Q8_0", "F16")


def test_refuses_unsupported_tokenizer(tmp_path):
    p = write_llama_gguf(tmp_path / "bert.gguf", hf_weights(2), tokenizer="bert")
    _refused(p, "'bert'", "'gpt2'", "'llama'", "tokenizer.json")


def test_refuses_extra_tensors(tmp_path, weights):
    bias = np.zeros(64, dtype=np.float32)
    p = write_llama_gguf(tmp_path / "bias.gguf", weights, extra_tensors={"blk.0.attn_q.bias": (bias, None)})
    _refused(p, "blk.0.attn_q.bias", "only the dense models")


def test_refuses_missing_tensors(tmp_path, weights):
    partial = {k: v for k, v in weights.items() if "layers.1.mlp" not in k}
    _refused(write_llama_gguf(tmp_path / "m.gguf", partial), "lacks 3 tensors", "blk.1.ffn_")


def test_refuses_non_llama3_rope_freqs(tmp_path, weights):
    freqs = np.linspace(1, 7, TINY["hidden"] // TINY["heads"] // 2, dtype=np.float32)
    _refused(write_llama_gguf(tmp_path / "r.gguf", weights, rope_freqs=freqs), "rope_freqs", "llama3")


def test_refuses_unsupported_rope_scaling(tmp_path, weights):
    p = write_llama_gguf(tmp_path / "yarn.gguf", weights,
                         extra_kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    _refused(p, "'yarn'", "supported: none, linear, and llama3")
