"""The fused CPU kernels (nanoserve/kernels/fused.c) against float64 references and against themselves in a crowd.

Each kernel is held to a float64 computation of the same formula, and a row computed alone must be bitwise the row
computed among others (the property that lets prefill and decode share them). Engine-level agreement (prefill
against decode, crowds against alone) is tests/test_determinism.py's, which runs on these kernels wherever a C
compiler exists; the oracle tests hold the fused decoder to transformers.
"""

from __future__ import annotations

import platform

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.build import find_compiler
from nanoserve.kernels.fused import load

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the fused kernels with")

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels():
    kernels, reason = load()
    assert kernels is not None, reason
    return kernels


def test_norm_matches_float64_and_adds_the_delta_in_place(kernels):
    torch.manual_seed(0)
    x, delta, w = torch.randn(5, 576), torch.randn(5, 576).to(BF16), torch.randn(576)
    expected_x = x.double() + delta.double()
    ref = expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out = kernels.add_norm(x, w, 1e-5, delta, torch.float32)
    assert torch.equal(x, (expected_x.float()))  # float32 + bfloat16 is exact in float64, then rounded once
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(kernels.add_norm(x.clone(), w, 1e-5, None, BF16), out.to(BF16))


def test_a_row_alone_is_the_row_in_a_crowd(kernels):
    torch.manual_seed(1)
    x, w = torch.randn(7, 576), torch.randn(576)
    crowd = kernels.add_norm(x.clone(), w, 1e-6, None, BF16)
    for r in range(7):
        assert torch.equal(kernels.add_norm(x[r: r + 1].clone(), w, 1e-6, None, BF16), crowd[r: r + 1])
    gate_up = torch.randn(7, 2 * 96).to(BF16)
    crowd = kernels.silu_mul(gate_up)
    assert all(torch.equal(kernels.silu_mul(gate_up[r: r + 1].contiguous()), crowd[r: r + 1]) for r in range(7))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_silu_mul_matches_float64(kernels, dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(3, 2 * 128) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bfloat16: the activation and the product each rounded
    torch.testing.assert_close(kernels.silu_mul(gate_up).double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["slots", "heads", "heads_kt"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_rotates_and_writes_what_the_eager_ops_do(kernels, layout, qk_norm):
    """q rotated, k rotated and v written at each token's slot; a slot of -1 writes nothing. The rotation is the
    eager one's arithmetic (x cos + roll(x) sin, each product rounded), so it agrees bitwise; with Qwen3's per-head
    norms it agrees to float32 rounding."""
    from nanoserve.kv.cache import KVCache
    from nanoserve.model.config import ModelConfig
    from nanoserve.model.layers import RMSNorm, RotaryEmbedding, apply_rope

    torch.manual_seed(3)
    heads, kv, dim, tokens = 4, 2, 64, 5
    cfg = ModelConfig(hidden_size=heads * dim, intermediate_size=64, num_layers=2, num_heads=heads, num_kv_heads=kv,
                      head_dim=dim, vocab_size=32, rms_norm_eps=1e-6, rope_theta=10000.0, architecture="llama",
                      rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=qk_norm, torch_dtype="float32")
    cache = KVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu", layout=layout)
    rope = RotaryEmbedding(dim, 64, 10000.0, None)
    positions = torch.tensor([0, 3, 7, 8, 20])
    slots = torch.tensor([1, 5, -1, 9, 14])
    cos, sin = rope.table(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv) * dim).to(BF16)
    norms = [RMSNorm(dim, 1e-6) for _ in range(2)] if qk_norm else [None, None]
    for n in norms:
        if n is not None:
            n.weight.data = torch.randn(dim)
    weights = [None if n is None else n.weight for n in norms]
    k_rows, v_rows = cache.layer_rows(1)
    flat = qkv.float()
    q_in = flat[:, : heads * dim].view(tokens, heads, dim)
    k_in = flat[:, heads * dim: (heads + kv) * dim].view(tokens, kv, dim)
    v_in = flat[:, (heads + kv) * dim:].view(tokens, kv, dim)
    if qk_norm:
        q_in, k_in = norms[0](q_in).detach(), norms[1](k_in).detach()
    q_ref, k_ref = apply_rope(q_in, cos, sin), apply_rope(k_in, cos, sin)
    q = kernels.rope_store(qkv, heads, kv, dim, cos, sin, *weights, 1e-6, k_rows, v_rows, slots,
                           cache.write_strides, cache.k_block)
    expected = KVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu",
                       layout="heads" if layout == "heads_kt" else layout)
    keep = slots >= 0
    expected.write(1, k_ref[keep], v_in[keep], slots[keep])
    compare = torch.testing.assert_close if qk_norm else lambda a, b: torch.equal(a, b) or pytest.fail("differs")
    compare(q, q_ref)
    compare(cache.k.transpose(-1, -2) if layout == "heads_kt" else cache.k, expected.k)
    assert torch.equal(cache.v, expected.v)


def test_refuses_what_it_cannot_compute(kernels):
    with pytest.raises(ValueError, match="contiguous float32 / bfloat16"):
        kernels.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 residual"):
        kernels.add_norm(torch.randn(2, 8).to(BF16), torch.ones(8), 1e-6, None, BF16)


def test_the_engine_publishes_what_ran_and_the_flag_turns_it_off(tiny_checkpoint):
    """The counters are the kernels' own: a generation moves them; with the flag off they are absent and the
    reason names the flag. Both engines answer (the numbers differ by rounding, not by meaning)."""
    path = str(tiny_checkpoint("llama"))
    on = LLM(model=path, max_model_len=128, kv_cache_gib=0.01)
    before = on.engine.stats().features["fused"]
    assert before["active"] and before["calls"]["rope_store"] == 0
    on.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    after = on.engine.stats().features["fused"]
    layers = on.engine.runner.model.config.num_layers
    assert after["calls"]["rope_store"] == layers * 4  # one prefill step and three decode steps
    assert after["rows"]["rope_store"] == layers * (4 + 3)
    off = LLM(model=path, max_model_len=128, kv_cache_gib=0.01, fused_cpu_kernels=False)
    status = off.engine.stats().features["fused"]
    assert status == {"active": False, "reason": "--no-fused-cpu-kernels"}


def test_without_a_compiler_the_eager_ops_run_and_say_why(tiny_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    status = llm.engine.stats().features["fused"]
    assert not status["active"] and "no-such-cc" in status["reason"]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_rescore_recomputes_each_rows_shortlist_and_nothing_else(kernels):
    torch.manual_seed(4)
    hidden, weight = torch.randn(3, 64), torch.randn(1000, 64)
    coarse = (hidden @ weight.T).to(BF16).float()
    out = kernels.rescore(coarse.clone(), hidden, weight, 16)
    for r in range(3):
        top = torch.sort(-coarse[r], stable=True).indices[:16]  # bfloat16 ties: the lower ids
        changed = (out[r] != coarse[r]).nonzero().flatten()
        assert set(changed.tolist()) <= set(top.tolist())
        exact = (weight[top].double() @ hidden[r].double())
        torch.testing.assert_close(out[r, top].double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.rescore(coarse[1:2].clone(), hidden[1:2], weight, 16), out[1:2])
    tied = torch.zeros(1, 40)  # all tied: the lowest ids are the shortlist
    kernels.rescore(tied, torch.ones(1, 64), torch.ones(40, 64), 16)
    assert tied[0, :16].eq(64).all() and tied[0, 16:].eq(0).all()


@pytest.mark.parametrize("block_size", [16, 4, 24])
def test_attention_matches_float64_over_every_query_of_a_chunk(kernels, block_size):
    """Causal attention read from a heads_kt cache through a scattered block table, for a chunk of queries at once
    and for each query alone (the decode shape): the two agree bitwise, and both with float64."""
    torch.manual_seed(5)
    heads, kv, dim, tokens = 6, 2, 64, 37
    blocks = torch.randperm(12)[: -(-tokens // block_size)]
    k_all, v_all = torch.randn(tokens, kv, dim), torch.randn(tokens, kv, dim)
    k_cache, v_cache = torch.zeros(kv, 12, dim, block_size), torch.zeros(kv, 12, block_size, dim)
    for p in range(tokens):
        b, o = int(blocks[p // block_size]), p % block_size
        k_cache[:, b, :, o], v_cache[:, b, o, :] = k_all[p], v_all[p]
    q = torch.randn(tokens, heads, dim)
    tables, keys_of = blocks[None].contiguous(), torch.arange(1, tokens + 1)
    most = tables.shape[1] * block_size
    scratch = kernels.attention_scratch(heads // kv, most, dim)
    chunk = kernels.attention(q, kv, k_cache, v_cache, tables, torch.zeros(tokens, dtype=torch.long), keys_of,
                              0.125, scratch, most, torch.float32)
    threaded = kernels.attention(q, kv, k_cache, v_cache, tables, torch.zeros(tokens, dtype=torch.long), keys_of,
                                 0.125, kernels.attention_scratch(heads // kv, most, dim, 3), most, torch.float32, 3)
    assert torch.equal(threaded, chunk)
    for t in range(tokens):
        alone = kernels.attention(q[t: t + 1].contiguous(), kv, k_cache, v_cache, tables, torch.zeros(1, dtype=torch.long),
                                  keys_of[t: t + 1].contiguous(), 0.125, scratch, most, torch.float32)
        assert torch.equal(alone[0], chunk[t]), t
        for h in range(heads):
            g = h // (heads // kv)
            weights = torch.softmax(k_all[: t + 1, g].double() @ q[t, h].double() * 0.125, 0)
            torch.testing.assert_close(chunk[t, h].double(), weights @ v_all[: t + 1, g].double(), rtol=2e-5,
                                       atol=2e-6)


@pytest.mark.parametrize("body, says", [("return 1;", "fail their self-test"),
                                        ("__builtin_trap(); return 0;", "crash in their self-test"),
                                        ("return 0;", "")])
def test_a_build_that_cannot_run_here_is_refused_with_the_reason(tmp_path, body, says):
    """A fresh build runs its self-test in a child process before it is cached: a library that traps (an
    instruction this CPU lacks) or fails is refused, and the message says which."""
    import subprocess

    from nanoserve.kernels.build import self_test_failure

    source, library = tmp_path / "probe.c", tmp_path / "probe.so"
    source.write_text(f"int ns_self_test(void) {{ {body} }}\n")
    subprocess.run([find_compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    failure = self_test_failure(library)
    assert (says in failure) if says else failure == ""


def _q4_weight(out: int, k: int, seed: int = 6):
    from nanoserve.model.quant.blocks import Int4Blocks

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(out, k // 32, generator=g) * 0.02 + 0.001).half().float()  # exact in float16
    zeros = (torch.randn(out, k // 32, generator=g) * 0.01).half().float()
    return Int4Blocks(codes, scales, zeros)


def _activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """linear.c's activation rounding: each row's groups of 32 as 16-bit codes (scale max |x| / 32767, rounded to
    nearest even in float32), as float64 codes [rows, groups, 32] and scales [rows, groups]."""
    rows, k = x.shape
    groups = x.view(rows, k // 32, 32)
    top = groups.abs().amax(-1, keepdim=True)
    # a tensor divided: torch's `scalar / tensor` is reciprocal(tensor) * scalar, two roundings where C has one
    inv = torch.where(top > 0, torch.full_like(top, 32767.0) / top, torch.zeros_like(top))
    codes = torch.round(groups * inv)  # float32 product, then half to even: the kernel's rounding
    return codes.double(), (top / 32767.0).double().squeeze(-1)


def _q4_terms(blocks, x: torch.Tensor) -> torch.Tensor:
    """linear.c's per-group terms in float64 after its activation rounding, [rows, out, groups]: the exact
    integer products, then the scales (the output is their sum in group order)."""
    codes, d = _activation_codes(x)
    q = blocks.codes.view(blocks.codes.shape[0], x.shape[1] // 32, 32).double() - 8
    products = torch.einsum("rgi,ogi->rog", codes, q)  # exact integers
    sums = codes.sum(-1)  # [rows, groups]
    return blocks.scales.double()[None] * d[:, None] * products + blocks.zeros.double()[None] * (d * sums)[:, None]


def _assert_float32_sum(y: torch.Tensor, terms: torch.Tensor, ops_per_term: int) -> None:
    """y is the float64 sum of `terms` [..., groups] up to float32's rounding as the kernel does it: each term
    rounded `ops_per_term` times, then added in order to a running sum. The bound is the textbook one for that
    sequence, (groups + ops_per_term) u sum |term| (u = 2^-24), so an output whose terms cancel is held to its
    terms' size, not its own, and a vector width or instruction set that reorders nothing passes with any data."""
    bound = (terms.shape[-1] + ops_per_term) * 2.0**-24 * terms.abs().sum(-1) + 1e-30
    excess = (y.double() - terms.sum(-1)).abs() / bound
    assert excess.max() <= 1.0, f"off by {excess.max():.2f}x the float32 bound at {divmod(int(excess.argmax()), y.shape[-1])}"


def test_q4_matmul_is_its_formula_and_close_to_the_dense_product(kernels):
    blocks = _q4_weight(96, 256)
    packed = kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros)
    x = torch.randn(5, 256)
    y = kernels.q4_matmul(packed, x, 96)
    _assert_float32_sum(y, _q4_terms(blocks, x), ops_per_term=4)  # d c, s (d c), z (d sum v), the add
    dense = x.double() @ blocks.dequantize().double().T
    assert ((y.double() - dense).abs().max() / dense.abs().max()) < 1e-4  # 16-bit activations


def test_q4_matmul_gives_a_row_the_same_bits_alone_in_a_crowd_and_on_any_threads(kernels):
    blocks = _q4_weight(160, 576)
    packed = kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros)
    x = torch.randn(9, 576)
    torch.set_num_threads(1)
    try:
        alone = [kernels.q4_matmul(packed, x[r: r + 1].contiguous(), 160) for r in range(9)]
    finally:
        torch.set_num_threads(2)
    crowd = kernels.q4_matmul(packed, x, 160)
    assert all(torch.equal(alone[r][0], crowd[r]) for r in range(9))
    for threads in (3, 4):
        torch.set_num_threads(threads)
        try:
            assert torch.equal(kernels.q4_matmul(packed, x, 160), crowd)
        finally:
            torch.set_num_threads(2)


@pytest.mark.parametrize("out", [48, 96])  # an odd and an even count of 16-output groups (the tiles take two)
def test_q4_matmul_on_the_tile_unit_gives_the_vector_paths_bits(kernels, out):
    """Calls of 6 rows and more run on AMX where the machine has it, 16 rows a tile (the last padded with zero
    rows): each row's product, and what it adds into an output, is bit for bit the vector path's, and the tile
    rows are counted."""
    if kernels.tiles == "none":
        pytest.skip("no AMX tiles on this machine (or the OS does not grant them)")
    blocks = _q4_weight(out, 192)
    packed = kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros)
    x = torch.randn(37, 192)
    x[3, :32] = 0  # an all-zero group
    x[7, 40:90] *= 1e4
    before = torch.randn(37, out)
    kernels.use_tiles(False)
    try:
        vector = kernels.q4_matmul(packed, x, out)
        vector_added = kernels.q4_matmul(packed, x, out, add_to=before.clone())
    finally:
        kernels.use_tiles(True)
    counted = kernels.tile_rows
    tiles = kernels.q4_matmul(packed, x, out)
    assert kernels.tile_rows - counted == 37  # three tiles, the last padded with zero rows
    for rows in (5, 6, 9):  # below the tiles' threshold, at it, and one padded tile
        counted = kernels.tile_rows
        assert torch.equal(kernels.q4_matmul(packed, x[:rows].contiguous(), out), vector[:rows])
        assert (kernels.tile_rows - counted) == (rows if rows >= 6 else 0)
    assert torch.equal(tiles, vector)
    assert torch.equal(kernels.q4_matmul(packed, x, out, add_to=before.clone()), vector_added)


def test_the_4bit_linears_run_on_the_q4x16_kernel_and_the_flag_puts_them_back(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    on = LLM(model=path, max_model_len=128, kv_cache_gib=0.01, quantization="int4")
    linear = on.engine.stats().features["linear"]
    assert linear["format"] == "q4x16" and linear["q4x16_calls"] == 0
    on.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert on.engine.stats().features["linear"]["q4x16_calls"] > 0
    off = LLM(model=path, max_model_len=128, kv_cache_gib=0.01, quantization="int4", fused_cpu_kernels=False)
    assert off.engine.stats().features["linear"]["format"] == "int4"


def _q8_weight(out: int, k: int, seed: int = 7):
    from nanoserve.model.quant.blocks import Int8Blocks

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(out, k // 32, generator=g) * 0.01 + 0.0005).half().float()  # GGUF Q8_0's f16 scales
    return Int8Blocks(codes, scales)


def _q8_terms(blocks, x: torch.Tensor) -> torch.Tensor:
    """The 8-bit kernel's per-group terms in float64 after its activation rounding (as _q4_terms'): its integer
    products pass 2^24, so their conversion to float32 rounds too."""
    codes, d = _activation_codes(x)
    q = blocks.codes.view(blocks.codes.shape[0], x.shape[1] // 32, 32).double()
    products = torch.einsum("rgi,ogi->rog", codes, q)  # exact integers
    return blocks.scales.double()[None] * d[:, None] * products


def _q8_reference(blocks, x: torch.Tensor) -> torch.Tensor:
    return _q8_terms(blocks, x).sum(-1)


def test_q8_matmul_is_its_formula_and_a_row_is_the_same_alone_in_a_crowd_and_on_the_tiles(kernels):
    """GGUF Q8_0 blocks as they are: the product is the float64 formula up to float32 rounding, a row alone is
    bit for bit the row among 36 others, and where AMX runs the crowd's rows in 16s the bits do not move."""
    blocks = _q8_weight(48, 192)  # three 16-output groups: the tiles' pairs and a lone one
    packed = kernels.q8_pack(blocks.codes, blocks.scales)
    x = torch.randn(37, 192) * 3
    x[3, :32] = 0
    x[7, 40:90] *= 1e4
    crowd = kernels.q8_matmul(packed, x, 48)
    _assert_float32_sum(crowd, _q8_terms(blocks, x), ops_per_term=4)  # (float) c, d c, s (d c), the add
    assert all(torch.equal(kernels.q8_matmul(packed, x[r: r + 1].contiguous(), 48)[0], crowd[r]) for r in range(37))
    kernels.use_tiles(False)
    try:
        assert torch.equal(kernels.q8_matmul(packed, x, 48), crowd)
    finally:
        kernels.use_tiles(True)


def test_a_q8_0_head_runs_on_the_8bit_kernel_where_it_is_vectorized(kernels):
    from nanoserve.model.quant.install import head_forms

    blocks = _q8_weight(64, 96)
    forms = head_forms(blocks.dequantize(), blocks, "auto", kernels)
    assert ("q8x16" in forms) == kernels.q8_vectorized and ("int8g32" in forms) != kernels.q8_vectorized
    x = torch.randn(3, 96)
    for name, build in forms.items():
        if name != "bfloat16":
            torch.testing.assert_close(build()(x).double(), _q8_reference(blocks, x), rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory) -> dict:
    """The kernels built as an AVX2-only machine and as a machine with no vector extensions would build them."""
    import ctypes
    import subprocess
    from importlib import resources

    from nanoserve.kernels.build import HEADERS, SOURCES
    from nanoserve.kernels.fused import FusedKernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 build is an x86-64 one")
    folder = tmp_path_factory.mktemp("variants")
    for name in (*SOURCES, *HEADERS):
        (folder / name).write_bytes(resources.files("nanoserve.kernels").joinpath(name).read_bytes())
    builds = {}
    # -mno-avx512f / -mno-avx: whatever -march the compiler ($CC) adds itself, a later -march included
    for name, flags in {"avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"], "portable": ["-mno-avx"]}.items():
        library = folder / f"{name}.so"
        subprocess.run([find_compiler(), "-O2", "-std=c11", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", *flags,
                        *(str(folder / n) for n in SOURCES), "-o", str(library), "-lm"], check=True)
        builds[name] = FusedKernels(ctypes.CDLL(str(library)), str(library))
    return builds


def _product(kernels, bits: int, x: torch.Tensor, out: int = 64, seed: int | None = None) -> torch.Tensor:
    k = x.shape[1]
    if bits == 4:
        blocks = _q4_weight(out, k, *([] if seed is None else [seed]))
        return kernels.q4_matmul(kernels.q4_pack(blocks.codes, blocks.scales, blocks.zeros), x, out)
    blocks = _q8_weight(out, k, *([] if seed is None else [seed]))
    return kernels.q8_matmul(kernels.q8_pack(blocks.codes, blocks.scales), x, out)


def _hard_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations that reach the kernels' extremes: codes of +-32767 (a group's largest), -32768's neighbour
    -32767 whose hi byte is -128, an all-zero group, a group of one value, and rows scaled far apart."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    if rows > 1:
        x[1, :32] = 0  # an all-zero group: scale 0
    if k >= 64:
        x[0, 32:64] = -1.0  # every code -32767: hi planes of -128
    x[-1, -32:] = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0)  # +-32767 alternating
    return x


@pytest.mark.parametrize("bits", [4, 8])
def test_the_linear_kernels_give_the_same_bits_built_for_avx2_and_for_plain_c(kernels, variant_builds, bits):
    """linear.c built for an AVX2-only machine and for one with no vector extensions: each product is the native
    build's, bit for bit (the integer sums are exact, the float part the same operations)."""
    x = torch.randn(5, 192)
    native = _product(kernels, bits, x)
    for name, variant in variant_builds.items():
        assert variant.q4_isa == name
        assert torch.equal(_product(variant, bits, x), native), name


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out, k", [(64, 192), (16, 32), (48, 96), (112, 576), (32, 1536)])
def test_every_build_gives_every_row_the_same_bits_in_any_call(kernels, variant_builds, bits, out, k):
    """The AVX2 build's multi-row paths (ROW_TILE rows sharing a group's unpacked weights) and the native and plain-C
    builds' against each other, bit for bit: calls of 1, 2, 3, 5, 8 and 37 rows (whole tiles, partial ones, the
    tile unit where the native build has it), odd shapes (one output group, one input group), rows at the codes'
    extremes, and on 1 and 3 threads. Each row must also be the row computed alone."""
    x = _hard_rows(37, k, seed=out + k + bits)
    builds = {"native": kernels, **variant_builds}
    alone = {name: torch.cat([_product(lib, bits, x[r: r + 1].contiguous(), out, seed=k) for r in range(37)])
             for name, lib in builds.items()}
    for name in variant_builds:
        assert torch.equal(alone[name], alone["native"]), name
    for rows in (1, 2, 3, 5, 8, 37):
        for name, lib in builds.items():
            for threads in (1, 3):
                torch.set_num_threads(threads)
                try:
                    y = _product(lib, bits, x[:rows].contiguous(), out, seed=k)
                finally:
                    torch.set_num_threads(2)
                assert torch.equal(y, alone["native"][:rows]), (name, rows, threads)
    assert alone["native"].isfinite().all()


@pytest.mark.parametrize("heads, kv, dim", [(6, 2, 64), (8, 1, 80), (5, 5, 40)])
def test_each_build_attends_a_query_alike_in_a_chunk_and_alone(kernels, variant_builds, heads, kv, dim):
    """The native, AVX2-only and plain-C builds of fused.c, over a prefill chunk beside two decode rows: in each,
    a query's output is the same bits in the chunk, alone, and on two threads (how its queries are grouped into
    score passes and value groups changes no chain), and close to the native build's. The builds differ from each
    other in the last bits: a softmax sum runs in as many lanes as the machine's vectors hold."""
    torch.manual_seed(11)
    block_size, tokens = 16, 29
    k_cache, v_cache = torch.randn(kv, 9, dim, block_size), torch.randn(kv, 9, block_size, dim)
    tables = torch.tensor([[3, 0, 0], [5, 1, 2], [8, 6, 4]])
    row_of = torch.tensor([0, 1] + [2] * tokens)
    keys_of = torch.tensor([7, 40] + list(range(12, 12 + tokens)))
    q = torch.randn(row_of.numel(), heads, dim)
    most = tables.shape[1] * block_size

    def attend(lib, rows, threads=1):
        return lib.attention(q[rows].contiguous(), kv, k_cache, v_cache, tables, row_of[rows].contiguous(),
                             keys_of[rows].contiguous(), 0.1, lib.attention_scratch(heads // kv, most, dim, threads),
                             most, torch.float32, threads)

    every = slice(None)
    for name, lib in {"native": kernels, **variant_builds}.items():
        together = attend(lib, every)
        assert torch.equal(attend(lib, every, 2), together), name
        for t in (0, 1, 2, 9, 10, 17, 30):
            assert torch.equal(attend(lib, slice(t, t + 1))[0], together[t]), (name, t)
        torch.testing.assert_close(together, attend(kernels, every), rtol=1e-5, atol=1e-6)
