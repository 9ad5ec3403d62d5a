"""Logits and greedy generations against Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention.dispatch import PagedRead
from nanoserve.kv.cache import KVCache
from nanoserve.model.batch import PrefillSegment, StepBatch

ARCHS = {
    "llama": {},
    "llama3-rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    "rope_theta": 50000.0},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "tied": {"tie_word_embeddings": True},
    "phi3": {},  # qkv_proj and gate_up_proj stored fused
    "phi3-longrope": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                       "long_factor": [2.0 + i / 4 for i in range(8)]},
                      "original_max_position_embeddings": 512, "max_position_embeddings": 4096},
}
KIND = {"llama3-rope": "llama", "tied": "llama", "phi3-longrope": "phi3"}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3,
]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tiny_checkpoint):
    name = request.param
    path = tiny_checkpoint(KIND.get(name, name), **ARCHS[name])
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gib=0.01, max_num_batched_tokens=256)
    return llm, hf_model(path)


def full_prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Our model's logits at every prompt position, from one prefill straight through the decoder."""
    engine = llm.engine
    n = len(ids)
    bs = engine.config.block_size
    blocks = list(range(1, -(-n // bs) + 1))
    cache = KVCache(engine.model_config, len(blocks) + 1, bs, engine.runner.dtype, engine.runner.device)
    batch = StepBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n),
        slots=torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)]),
        num_decode=0, decode_block_table=torch.zeros(0, 1, dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=(PrefillSegment(0, n, 0),), logits_indices=torch.arange(n),
    )
    with torch.inference_mode():
        return engine.runner.model(batch, cache, PagedRead())


def test_prefill_logits_match_transformers(pair):
    llm, hf = pair
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ours = full_prefill_logits(llm, ids)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


class RecordingSampler:
    """Wraps the engine's real sampler and keeps the logits it was handed, per request, in order."""

    def __init__(self, engine):
        self.inner = engine.runner.sampler
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits, rows):
        self.seen.append(logits.clone())
        return self.inner(logits, rows)


def test_decode_logits_and_greedy_tokens_match_transformers(pair):
    llm, hf = pair
    engine = llm.engine
    recorder = RecordingSampler(engine)
    engine.runner.sampler = recorder
    try:
        for prompt in PROMPTS:
            recorder.seen.clear()
            ids = llm.tokenizer.encode(prompt)
            out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
            tokens = list(out.outputs[0].token_ids)
            assert len(tokens) == 24
            full = torch.tensor([ids + tokens])
            with torch.inference_mode():
                theirs = hf(full).logits[0, len(ids) - 1 : -1]
            ours = torch.cat(recorder.seen)  # one row per step: the prefill, then every decode step
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
            with torch.inference_mode():
                generated = hf.generate(
                    torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )[0, len(ids):].tolist()
            assert tokens == generated
    finally:
        engine.runner.sampler = recorder.inner
    engine.audit()


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint):
    import os

    sharded = tiny_checkpoint("llama", _shard="2MB")
    assert any(f.endswith(".index.json") for f in os.listdir(sharded))
    single = tiny_checkpoint("llama")
    a = LLM(model=str(sharded), max_model_len=128, kv_cache_gib=0.01)
    b = LLM(model=str(single), max_model_len=128, kv_cache_gib=0.01)
    for (na, pa), (nb, pb) in zip(a.engine.runner.model.state_dict().items(), b.engine.runner.model.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_greedy_stays_close_to_transformers(tiny_checkpoint, dtype):
    """Half-precision weights: logits near transformers' at the same dtype (loose: accumulation order differs)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen2")
    llm = LLM(model=str(path), dtype=dtype, max_model_len=128, kv_cache_gib=0.01)
    assert llm.engine.runner.dtype == getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = llm.tokenizer.encode(PROMPTS[0])
    ours = full_prefill_logits(llm, ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()


def test_logprobs_equal_transformers_log_softmax(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    llm = LLM(model=str(path), max_model_len=128, kv_cache_gib=0.01)
    hf = hf_model(path)
    ids = llm.tokenizer.encode(PROMPTS[0])
    result = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                                                prompt_logprobs=3))[0]
    out = result.outputs[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids + list(out.token_ids)])).logits[0].double(), -1)
    for step, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + step]
        token = out.token_ids[step]
        assert next(iter(lp)) == token and lp[token].rank == 1  # greedy: the sampled token is the argmax
        assert abs(lp[token].logprob - row[token].item()) < 1e-4
        top = sorted((x.rank, t) for t, x in lp.items())
        assert [t for _, t in top] == row.topk(5).indices.tolist()
        for t, x in lp.items():
            assert abs(x.logprob - row[t].item()) < 1e-4
            assert x.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert abs(out.cumulative_logprob - sum(ref[len(ids) - 1 + i, t].item() for i, t in enumerate(out.token_ids))) < 1e-3
    # prompt logprobs: None first, then each prompt token scored by the logits at the position before it
    assert len(result.prompt_logprobs) == len(ids) and result.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        lp, row = result.prompt_logprobs[pos], ref[pos - 1]
        token = ids[pos]
        assert next(iter(lp)) == token and abs(lp[token].logprob - row[token].item()) < 1e-4
        # the rank, up to tokens whose logprobs lie within float32's reach of this one
        assert int((row > row[token] + 1e-4).sum()) + 1 <= lp[token].rank <= int((row > row[token] - 1e-4).sum()) + 1
        assert {t for t, x in lp.items() if t != token or x.rank <= 3} >= set(row.topk(3).indices.tolist())
