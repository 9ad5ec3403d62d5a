"""`nanoserve bench sizes`: its random-weight files are the real models' shapes, load as they are, and carry the
default model's tokenizer; with llama-cpp-python, llama.cpp's quantizer writes the types asked."""

from __future__ import annotations

import math

import pytest

from nanoserve.bench.gguf_files import SHAPES, _tensors, write_random_gguf


def test_the_8b_shape_has_llama_3_1_8bs_parameters_outside_the_vocabulary():
    """Meta's Llama-3.1-8B: 6.98B parameters besides its embedding and head (32 layers of 4096 wide, 8 kv heads,
    14,336 MLP), whatever the vocabulary."""
    blocks = [math.prod(dims) for name, dims in _tensors(SHAPES["llama-3.1-8b"], vocab=1)
              if name.startswith("blk.") or name == "output_norm.weight"]
    assert round(sum(blocks) / 1e9, 2) == 6.98


def test_a_written_file_loads_with_the_default_models_tokenizer(tmp_path):
    from nanoserve.model.gguf import read_gguf_header
    from nanoserve.model.loader import default_model_path

    path = write_random_gguf(tmp_path / "smoke-F16.gguf", "smoke")
    header = read_gguf_header(path)
    hidden, layers, heads, kv_heads, inter, tied, _ = SHAPES["smoke"]
    cfg = header.config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (hidden, layers, heads, kv_heads, inter, tied)
    default = read_gguf_header(default_model_path())
    text = "The capital of France is Paris."
    assert header.tokenizer.encode(text).ids == default.tokenizer.encode(text).ids
    assert cfg["vocab_size"] == default.config["vocab_size"]


def test_llama_cpps_quantizer_writes_the_type_and_both_engines_run_it(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer needs llama-cpp-python (the peers extra)")
    from argparse import Namespace

    from nanoserve.bench.sizes import gguf_file, run_arm
    from nanoserve.model.gguf.reader import parse

    path = gguf_file(tmp_path, "smoke", "Q4_K_M", threads=1)
    _, infos = parse(path)
    assert {i.type_name for i in infos if i.name.endswith("ffn_gate.weight")} <= {"Q4_K", "Q6_K"}
    args = Namespace(threads=1, decode_tokens=8, prompt_tokens=32, streams=[2], batch_tokens=4, kv_cache_gib=0.01)
    for engine in ("nanoserve", "llama.cpp"):
        got = run_arm(engine, path, args)
        assert got["load_s"] > 0 and got["decode_tok_s"] > 0 and got["prefill_tok_s"] > 0, engine
        assert got["rss_after_load_mib"] <= got["peak_rss_mib"], engine
        assert got["kv_pool_mib"] > 0 and got["streams_2_tok_s"] > 0, engine  # llama.cpp's as two slots


def test_llama_cpps_slots_generate_what_it_generates_alone(tmp_path):
    """The slots arm decodes every sequence in one batch a step; on a file where greedy is decisive (a Q8_0 of
    the smoke shape) each sequence's tokens are those llama.cpp makes for it alone."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's arm needs llama-cpp-python (the peers extra)")
    from nanoserve.bench.llama_cpp_slots import generate_in_slots
    from nanoserve.bench.sizes import gguf_file

    path = gguf_file(tmp_path, "smoke", "Q8_0", threads=1)
    llm = llama_cpp.Llama(model_path=str(path), n_threads=1, n_ctx=128, verbose=False)
    prompts = [[1000 + 7 * i for i in range(n)] for n in (5, 9, 3)]
    alone = []
    for prompt in prompts:
        made = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made.append(token)
            if len(made) == 6:
                break
        alone.append(made)
    assert generate_in_slots(llm, prompts, 6, threads=1) == alone
    llm.close()
