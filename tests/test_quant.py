"""The int4 seam against its oracles: the file's own dequantization, a float64 matmul on the dequantized weight,
and the dense float32 path by vLLM's "logprobs close" rule (equal tokens up to the first divergence, and there
each side's token is in the other's top 5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from nanoserve import LLM, SamplingParams
from nanoserve.model.gguf.dequant import dequantize
from nanoserve.model.quant import (
    Int4Blocks,
    Int4Linear,
    Int8Blocks,
    Int8GroupLinear,
    Int8Linear,
    fastest_head,
    int4_supported,
)
from nanoserve.model.quant.install import head_forms
from nanoserve.stats import Numerics
from tests.oracles import logprobs_close

pytestmark = pytest.mark.skipif(not int4_supported(torch.device("cpu")), reason="this torch has no int4 CPU kernel")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:"]


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of random Q4_0 / Q4_1 blocks with sane float16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    width = {"Q4_0": 18, "Q4_1": 20}[type_name]
    raw = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.001, 0.05, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
    if type_name == "Q4_1":
        raw[:, 2:4] = (rng.uniform(-0.4, 0.1, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_blocks_reproduce_the_files_dequantized_weights(type_name):
    raw = random_blocks(type_name, 64, 256)
    reference = dequantize(raw, getattr(GGMLQuantizationType, type_name), (64, 256))
    blocks = Int4Blocks.from_gguf(raw, type_name, (64, 256))
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    # (q - 8) d + (m + 8 d) against the file's d q + m: the same value, up to float32 rounding of the sum
    torch.testing.assert_close(blocks.dequantize(), torch.from_numpy(reference), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_a_files_4bit_rows_pack_straight_from_their_bytes_as_from_their_codes(type_name):
    """GgufInt4Rows keeps the file's bytes: the fused kernel packs them with no unpacked copy, into the very bytes
    it packs from the Int4Blocks they stand for; reordered, stacked and cut, they stay those blocks."""
    from nanoserve.kernels.fused import load
    from nanoserve.model.quant import GgufInt4Rows

    kernels, why = load()
    if kernels is None:
        pytest.skip(f"the fused kernels cannot run here: {why}")
    raw = random_blocks(type_name, 48, 256, seed=3)
    rows, blocks = GgufInt4Rows.from_gguf(raw, type_name, (48, 256)), Int4Blocks.from_gguf(raw, type_name, (48, 256))
    packed = kernels.q4_pack_gguf(rows.raw, type_name, 256)
    assert torch.equal(packed, kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros))
    assert torch.equal(rows.dequantize(), blocks.dequantize())
    order = np.random.default_rng(4).permutation(48)
    assert torch.equal(rows.rows(order).dequantize(), blocks.rows(order).dequantize())
    assert torch.equal(GgufInt4Rows.cat([rows, rows.slice(0, 16, 32)]).dequantize(),
                       Int4Blocks.cat([blocks, blocks.rows(np.arange(16, 32))]).dequantize())
    assert torch.equal(rows.slice(1, 64, 192).dequantize(), blocks.dequantize()[:, 64:192])
    assert rows.slice(1, 16, 64) is None  # not whole blocks of 32


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_linear_equals_a_float64_matmul_on_the_dequantized_weight(rows):
    blocks = Int4Blocks.from_gguf(random_blocks("Q4_1", 96, 256, seed=1), "Q4_1", (96, 256))
    weight = blocks.dequantize().double()
    for dense_from_rows in (None, 2):  # the packed kernel alone, and with the dense copy taking wide calls
        linear = Int4Linear(blocks, None, dense_from_rows=dense_from_rows)
        x = torch.randn(rows, 256)
        y = linear(x)
        ref = x.double() @ weight.t()
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)  # the packed seam answers in bfloat16
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2  # bfloat16 activations
        kernel = "dense" if dense_from_rows is not None and rows >= dense_from_rows else "int4"
        assert linear.calls == {"int4": int(kernel == "int4"), "dense": int(kernel == "dense")}


def test_int8_head_equals_a_float64_matmul_within_its_rounding():
    w = torch.randn(500, 128) * 0.05
    x = torch.randn(3, 128)
    y, ref = Int8Linear(w)(x).double(), x.double() @ w.double().t()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-2  # int8 per row and bfloat16 activations
    assert fastest_head(w) in ("own", "bfloat16")  # a dense head is never re-rounded to int8 unasked


def test_the_head_is_offered_the_forms_its_mode_and_file_allow():
    """Lossy re-rounding (int8 per row) only under --quantization int4 / int8; the file's own blocks whenever
    the head came quantized; a bfloat16 copy always."""
    w = torch.randn(64, 128) * 0.05
    q4 = Int4Blocks.quantize(w)
    for mode in ("auto", "none"):
        assert set(head_forms(w, None, mode)) == {"bfloat16"}
        assert set(head_forms(w, q4, mode)) == {"bfloat16", "int4"}
    for mode in ("int4", "int8"):
        assert set(head_forms(w, None, mode)) == {"bfloat16", "int8"}
        assert set(head_forms(w, q4, mode)) == {"bfloat16", "int4", "int8"}
    assert fastest_head(w, mode="int8") in {"own", *head_forms(w, None, "int8")}


def test_quantize_at_load_round_trips_within_a_step():
    w = torch.randn(64, 128) * 0.05
    blocks = Int4Blocks.quantize(w)
    step = (w.view(64, 4, 32).amax(-1) - w.view(64, 4, 32).amin(-1)) / 15
    err = (blocks.dequantize() - w).abs().view(64, 4, 32)
    assert (err <= step[..., None] / 2 + 1e-6).all()


def packed_format(llm) -> str:
    """The 4-bit linears' format: q4x16 (the fused library's 4-bit x 16-bit kernel) where the fused CPU kernels
    run, torch's int4 kernel elsewhere."""
    return "q4x16" if llm.engine.stats().features["fused"]["active"] else "int4"


@pytest.fixture(scope="module")
def dense_and_int4(default_llm_dense, default_llm):
    assert default_llm.engine.stats().features["linear"]["format"] == packed_format(default_llm)
    assert "linear" not in default_llm_dense.engine.stats().features
    return default_llm_dense, default_llm


def test_the_snapshot_says_what_runs_as_built(dense_and_int4):
    """The flags say dtype auto for both; what the engines built differs, and the snapshot says which."""
    dense, int4 = dense_and_int4
    plain = "batch-invariant"  # the default flags
    assert dense.engine.stats().numerics == Numerics("float32", "float32", "float32", plain)
    packed = int4.engine.stats().numerics
    linear = int4.engine.stats().features["linear"]
    head = f"{linear['head']} + float32 top 16"  # a coarse head tied to the float32 embedding: its shortlist rescored
    assert linear["head_rescored"] == 16
    form = packed_format(int4)
    # what each kernel multiplies by: the fused library's take 16-bit codes per 32 inputs, torch's bfloat16. The
    # head's form is the one this machine timed fastest (on an AVX2-only EPYC q8x16 since it has an AVX2 path: 979 us
    # a row against bfloat16's 1929).
    on_codes = form == "q4x16"
    head_codes = linear["head"] == "q8x16" or (linear["head"] == "int8g32" and on_codes)
    activations = "+".join(sorted({"int16 per 32" if on_codes else "bfloat16",
                                   "int16 per 32" if head_codes else "bfloat16"}))
    assert packed == Numerics(f"{form} (head {head}, rest float32)", f"{activations} in linears, float32", "float32",
                              plain)


def test_default_model_int4_is_logprobs_close_to_dense_float32(dense_and_int4):
    dense, int4 = dense_and_int4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    ours = [o.outputs[0] for o in int4.generate(PROMPTS, params, use_tqdm=False)]  # a crowd
    solo = [int4.generate(p, params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    reference = [o.outputs[0] for o in dense.generate(PROMPTS, params, use_tqdm=False)]
    agreed = []
    for got, alone, ref in zip(ours, solo, reference):
        for side in (got, alone):
            ok, equal = logprobs_close(side, ref)
            assert ok, (side.text, ref.text, equal)
            agreed.append(equal)
    assert sum(agreed) >= len(agreed) * 24 // 4  # not merely close at the first token: a long shared prefix


def test_default_model_int4_seeded_runs_are_reproducible(dense_and_int4):
    """Seeded sampling has no closeness rule against other weights (a drawn token may be unlikely on either
    side); what it must keep under int4 is its own promise: the same seed and prompt give the same text."""
    _, int4 = dense_and_int4
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    first = [int4.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
    again = [int4.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
    assert first == again and len(set(first)) == len(PROMPTS)


def test_the_snapshot_counts_the_kernel_each_call_used(default_llm):
    before = default_llm.engine.stats().features["linear"]
    default_llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    after = default_llm.engine.stats().features["linear"]
    # 4 steps through 120 linears; the prefill of a short prompt stays below every dense crossover here or not,
    # but every call is counted by exactly one kernel
    form = packed_format(default_llm)
    calls = (after[f"{form}_calls"] + after["dense_calls"]) - (before[f"{form}_calls"] + before["dense_calls"])
    assert calls == 4 * after["modules"]
    assert after["packed_bytes"] > 0 and set(after["dense_from_rows"]) == {
        f"{form} 960x576", f"{form} 576x576", f"{form} 3072x576", f"{form} 576x1536"}


def test_the_snapshot_counts_the_rows_each_kernel_served(default_llm):
    """A 40-token prefill and three one-row decodes pass 43 rows through every linear; each row is counted by
    the one kernel that served it, and a width under every crossover is never sent to the dense copy."""
    before = default_llm.engine.stats().features["linear"]["rows_by_kernel"]
    default_llm.generate({"prompt_token_ids": list(range(1000, 1040))}, SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    linear = default_llm.engine.stats().features["linear"]
    after = linear["rows_by_kernel"]
    form = packed_format(default_llm)
    assert set(after) == {form, "dense"}
    grew = {k: after[k] - before[k] for k in after}
    assert sum(grew.values()) == 43 * linear["modules"]
    crossovers = [r for r in linear["dense_from_rows"].values() if r is not None]
    if not crossovers or min(crossovers) > 40:
        assert grew["dense"] == 0
    if min(crossovers, default=2) > 1:
        assert grew[form] >= 3 * linear["modules"]  # the one-row decodes stay packed


@pytest.fixture(scope="module")
def on_grid_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny llama with every decoder linear moved onto its own 4-bit grid (quantized and dequantized), so
    quantizing it again at load loses nothing and the int4 path differs from dense float32 only by its
    bfloat16 activations: that isolates the seam from the quality of 4-bit quantization itself."""
    import shutil

    import transformers

    src = tiny_checkpoint("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(Int4Blocks.quantize(module.weight).dequantize())
    out = tmp_path_factory.mktemp("tiny-on-grid")
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out)
    return out


def test_an_hf_checkpoint_quantized_at_load_is_logprobs_close(on_grid_checkpoint):
    path = str(on_grid_checkpoint)
    dense = LLM(model=path, max_model_len=128, kv_cache_gib=0.01)
    assert "linear" not in dense.engine.stats().features  # auto never quantizes a dense checkpoint by itself
    int4 = LLM(model=path, max_model_len=128, kv_cache_gib=0.01, quantization="int4")
    assert int4.engine.stats().features["linear"]["modules"] == 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    for ref, got in zip(dense.generate(PROMPTS, params, use_tqdm=False), int4.generate(PROMPTS, params,
                                                                                       use_tqdm=False)):
        ok, equal = logprobs_close(got.outputs[0], ref.outputs[0])
        assert ok, (got.outputs[0].text, ref.outputs[0].text, equal)


def test_two_engines_in_one_process_choose_the_same_kernels(default_llm):
    """An A/B run holds two engines in one process: with the crossover measured once, the same crowd gives the
    same bytes on both, so only the switch under test can make them differ."""
    other = LLM(max_model_len=2048, kv_cache_gib=0.25)
    assert other.engine.stats().features["linear"]["dense_from_rows"] == \
        default_llm.engine.stats().features["linear"]["dense_from_rows"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)] * 2
    texts = [[o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
             for llm in (default_llm, other)]
    assert texts[0] == texts[1]


def test_int8_at_load_is_logprobs_close_and_serves_both_kernels(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    dense = LLM(model=path, max_model_len=128, kv_cache_gib=0.01)
    int8 = LLM(model=path, max_model_len=128, kv_cache_gib=0.01, quantization="int8")
    linear = int8.engine.stats().features["linear"]
    assert linear["format"] == "int8" and linear["int8_modules"] == 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    for ref, got in zip(dense.generate(PROMPTS, params, use_tqdm=False), int8.generate(PROMPTS, params,
                                                                                       use_tqdm=False)):
        ok, equal = logprobs_close(got.outputs[0], ref.outputs[0])
        assert ok, (got.outputs[0].text, ref.outputs[0].text, equal)
    after = int8.engine.stats().features["linear"]
    assert after["int8_calls"] + after["dense_calls"] == 8 * int8.engine.stats().scheduler.steps


def test_int8_linear_equals_a_float64_matmul_on_its_dequantized_weight():
    w = torch.randn(96, 256) * 0.05
    linear = Int8Linear(w)
    x = torch.randn(5, 256)
    ref = x.double() @ linear.dequantize().double().t()
    assert ((linear(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-2  # bfloat16 activations
    # half a step of rounding plus the kernel's bfloat16 scale (up to another half step at the largest code)
    assert ((linear.dequantize() - w).abs() <= (w.abs().amax(1) / 127)[:, None]).all()


def random_q8_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of random Q8_0 blocks: every code -128..127 occurs, with sane float16 scales."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    raw = rng.integers(0, 256, size=(n, 34), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.0005, 0.01, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
    return raw.reshape(-1)


def test_q8_0_blocks_and_their_two_int4_planes_reproduce_the_files_weights():
    raw = random_q8_blocks(64, 256)
    blocks = Int8Blocks.from_gguf(raw, (64, 256))
    reference = dequantize(raw.copy(), GGMLQuantizationType.Q8_0, (64, 256))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))  # d * q: exact in float32
    hi, lo = blocks.planes()
    assert hi.codes.max() <= 15 and lo.codes.max() <= 15
    assert torch.equal(hi.dequantize() + lo.dequantize(), blocks.dequantize())  # powers of two: exact


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_group_linear_equals_a_float64_matmul_on_the_files_weights(rows):
    blocks = Int8Blocks.from_gguf(random_q8_blocks(96, 256, seed=2), (96, 256))
    weight = blocks.dequantize().double()
    for dense_from_rows in (None, 2):
        linear = Int8GroupLinear(blocks)
        linear.use_dense_from(dense_from_rows, blocks.dequantize())
        x = torch.randn(rows, 256)
        ref = x.double() @ weight.t()
        y = linear(x)
        # bfloat16 activations and scales: the rounding a bfloat16 copy of the weight would add, not int8 per row's
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
        per_row = Int8Linear(blocks.dequantize())(x).double()
        assert (y.double() - ref).norm() < (per_row - ref).norm()


def test_a_q8_0_file_keeps_its_blocks_and_is_logprobs_close_to_dense(tmp_path):
    from tests.gguf_fixtures import byte_level_vocab, hf_weights, write_llama_gguf

    weights = hf_weights(len(byte_level_vocab()[0]), tie=True)
    path = write_llama_gguf(tmp_path / "q8.gguf", weights, qtype="Q8_0")
    dense = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01, quantization="none")
    kept = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01)
    linear = kept.engine.stats().features["linear"]
    fused = kept.engine.runner.model.fused
    form = "q8x16" if fused is not None and fused.q8_vectorized else "int8g32"  # the 8-bit kernel, or two planes
    assert linear["format"] == form and linear[f"{form}_modules"] == linear["modules"] > 0
    assert "int8" not in linear["head_us"]  # per-row int8 re-rounds the file's head: only on request
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = [[1, 5, 9, 20], [3, 4, 5], [7, 30, 31, 40, 41]]
    for ref, got in zip(dense.generate(prompts, params, use_tqdm=False),
                        kept.generate(prompts, params, use_tqdm=False)):
        ok, equal = logprobs_close(got.outputs[0], ref.outputs[0])
        assert ok, (got.outputs[0].token_ids, ref.outputs[0].token_ids, equal)
