"""Speculative decoding (nanoserve/speculative/): prompt-lookup drafts verified in one step change no output.

Every comparison runs the same requests through an engine without speculation and one with it, and asks for the
same tokens, text, logprobs and finish reasons, byte for byte."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError
from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.speculative.ngram import propose

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _outputs(llm: LLM, prompts, params) -> list[tuple]:
    """Everything a client sees of each completion."""
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.cumulative_logprob,
             [sorted(lp.items()) for lp in o.logprobs or []])
            for r in llm.generate(prompts, params, use_tqdm=False) for o in r.outputs]


def _pair(path, **flags) -> tuple[LLM, LLM]:
    base = LLM(model=path, max_model_len=512, kv_cache_gib=0.02, **flags)
    return base, LLM(model=path, max_model_len=512, kv_cache_gib=0.02, speculative_config=NGRAM, **flags)


def _repetitive(n: int) -> list[list[int]]:
    """Prompts with repeats in them, so prompt lookup finds drafts from the first step."""
    return [[3 + (i + j) % 7 for j in range(30 + 5 * i)] for i in range(n)]


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 4) == [4, 5, 1]
    assert propose([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, 1, 3) == [8, 2]  # "2 3" occurs twice: the later one
    assert propose([1, 2, 3], 3, 2, 4) == []  # no earlier occurrence of any suffix of 2..4 tokens
    assert propose([5, 6, 5], 4, 1, 1) == [6, 5, 6, 5]  # a copy reaching the end goes on with its own drafts


def test_prompt_lookup_agrees_with_comparing_every_window():
    """The narrowing search against the plain one (every n-gram window compared with the suffix, the copy taken
    with overlap), on short sequences over a 4-token alphabet, where suffixes repeat often and at every length."""
    import random

    import numpy as np

    def every_window(tokens, k, low, high):
        seq = np.asarray(tokens)
        for n in range(min(high, len(seq) - 1), low - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[len(seq) - n:]).all(axis=1))
            if hits.size:
                text = seq.tolist()
                start = int(hits[-1]) + n
                for i in range(k):  # copying with overlap, as LZ77 does
                    text.append(text[start + i])
                return text[len(seq):]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        low = rng.randrange(1, 4)
        high = low + rng.randrange(3)
        assert propose(tokens, 3, low, high) == every_window(tokens, 3, low, high), (tokens, low, high)


@pytest.mark.parametrize("value, says", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "supported: ngram"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "not supported; supported:"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ("{not json", "not JSON"),
])
def test_an_unknown_method_or_key_is_refused_with_what_is_supported(value, says):
    with pytest.raises(ConfigError, match=says):
        SpeculativeConfig.parse(value)


def test_lookup_lengths_follow_vllm_when_one_or_neither_is_given():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


def test_speculation_needs_the_batch_invariant_path(tiny_checkpoint):
    with pytest.raises(ConfigError, match="batch_invariant"):
        LLM(model=str(tiny_checkpoint("llama")), batch_invariant=False, speculative_config=NGRAM)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_and_seeded_outputs_are_byte_identical_with_and_without_speculation(tiny_checkpoint, kind):
    """Greedy, seeded at temperature 1 with top-k, with penalties over the history (which must include the drafts
    before a verified position), n = 2, min_tokens and logprobs: the same bytes, and drafts were kept."""
    base, spec = _pair(str(tiny_checkpoint(kind)))
    prompts = _repetitive(4)
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=40, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3, frequency_penalty=0.5,
                                  max_tokens=30, min_tokens=10, n=2)):
        assert _outputs(spec, prompts, params) == _outputs(base, prompts, params)
    counters = spec.engine.stats().features["speculative"]
    assert counters["num_accepted_tokens"] > 0, counters


def test_max_tokens_and_stop_strings_inside_a_draft_run_end_the_output_where_one_at_a_time_would(tiny_checkpoint):
    base, spec = _pair(str(tiny_checkpoint("llama")))
    prompts = _repetitive(3)
    whole = base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stops = [r.outputs[0].text[len(r.outputs[0].text) // 2:][:3] for r in whole]  # strings that occur mid-output
    for params in (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 13)):
        assert _outputs(spec, prompts, params) == _outputs(base, prompts, params)
    for stop in stops:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        assert _outputs(spec, prompts, params) == _outputs(base, prompts, params)


def test_the_counters_add_up_per_position_and_per_request(tiny_checkpoint):
    _, spec = _pair(str(tiny_checkpoint("llama")))
    engine = spec.engine
    seen = []
    step = engine.step

    def watching():
        seen.extend(engine.scheduler.running)
        return step()

    engine.step = watching
    spec.generate(_repetitive(3), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    c = engine.stats().features["speculative"]
    assert 0 < c["num_accepted_tokens"] <= c["num_draft_tokens"] <= 4 * c["num_drafts"]
    assert sum(c["num_accepted_tokens_per_pos"]) == c["num_accepted_tokens"]
    assert sorted(c["num_accepted_tokens_per_pos"], reverse=True) == c["num_accepted_tokens_per_pos"]
    requests = {r.serial: r for r in seen}.values()
    assert sum(r.spec_draft_tokens for r in requests) == c["num_draft_tokens"]
    assert sum(r.spec_accepted_tokens for r in requests) == c["num_accepted_tokens"]
    assert engine.scheduler.generation_tokens == 120  # every kept token counted once
    # decode-only steps are timed as drafting or plain: together they made every token but the 3 first ones
    assert c["drafting_steps_tokens"] + c["plain_steps_tokens"] == 117 and c["drafting_steps_s"] > 0


def test_preemption_mid_draft_loses_nothing_and_leaves_the_pool_clean(tiny_checkpoint):
    """A pool too small for every row at once: rows are preempted (their drafted KV with them) and recomputed;
    the outputs are those of the unpreempted engine without speculation, and every block is accounted for."""
    path = str(tiny_checkpoint("llama"))
    base = LLM(model=path, max_model_len=256, kv_cache_gib=0.02)
    spec = LLM(model=path, max_model_len=256, kv_cache_gib=17 * BLOCK_BYTES / 2**30, speculative_config=NGRAM)
    prompts, params = _repetitive(6), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert _outputs(spec, prompts, params) == _outputs(base, prompts, params)
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.stats().features["speculative"]["num_accepted_tokens"] > 0
    spec.engine.audit()
    assert spec.engine.kv.num_used == 0


def test_structured_output_requests_draft_within_their_grammar_and_keep_their_output(tiny_checkpoint):
    """A grammar whose output repeats ("yes, yes, ..., no") gives prompt lookup drafts from the answer so far; a
    draft is cut where the grammar would refuse it, each verified position is masked by the grammar's state after
    the drafts before it, and the output is byte for byte the unspeculated one. A grammar the prompt's tokens
    break (a choice) has its drafts cut away."""
    base, spec = _pair(str(tiny_checkpoint("llama")))
    for constraint in ({"regex": "(yes, ){3,12}no"}, {"choice": ["yes", "no", "maybe"]}):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
        assert _outputs(spec, _repetitive(3), params) == _outputs(base, _repetitive(3), params)
    counters = spec.engine.stats().features["speculative"]
    assert counters["num_accepted_tokens"] > 0 and counters["grammar_cut_tokens"] > 0, counters


def test_the_default_model_copies_a_paragraph_with_fewer_steps_and_the_same_text(default_llm):
    """Real text on the default model: asked to repeat a paragraph, most tokens are drafted from the prompt and
    kept, so the answer takes far fewer steps than tokens, and it is the answer decoding one at a time gives."""
    spec = LLM(max_model_len=2048, kv_cache_gib=0.25, speculative_config=NGRAM)
    paragraph = ("The lighthouse keeper climbed the stairs every evening at dusk, lit the great lamp, and wrote the "
                 "weather in a leather book that had belonged to his grandfather.")
    messages = [{"role": "user", "content": f"Repeat this paragraph exactly, word for word:\n\n{paragraph}"}]
    params = SamplingParams(temperature=0, max_tokens=60)
    want = default_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    steps_before = spec.engine.runner.steps
    got = spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert spec.engine.runner.steps - steps_before < 0.6 * len(got.token_ids)


def test_a_requests_draft_length_follows_what_it_keeps():
    """First drafts are short; a draft kept whole lets the next be twice as long (up to the configured most), one
    that fails at its j-th token makes the next j + 1; a request that keeps too little pauses, and a crowded step
    drafts nothing."""
    from types import SimpleNamespace

    from nanoserve.request import Request
    from nanoserve.scheduler import Chunk
    from nanoserve.speculative import drafter as drafter_module
    from nanoserve.speculative.drafter import Drafter

    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1})
    drafter = Drafter(config)
    req = Request("r", None, [5, 6, 7] * 10, SamplingParams(max_tokens=100), 100)

    def verify(kept: int) -> int:
        drafts = drafter.propose(req, 100, 1)
        drafter.observe(SimpleNamespace(decodes=[Chunk(req, 0, 1, drafts)]), {req.serial: min(kept, len(drafts))})
        return len(drafts)

    assert [verify(99) for _ in range(4)] == [2, 4, 8, 8]  # kept whole: doubled, up to 8
    assert verify(2) == 8 and verify(99) == 3  # failed at its third token: the next drafts 3
    assert drafter.propose(req, 100, drafter_module.MAX_DRAFT_ROWS + 1) == ()
    for _ in range(2 * drafter_module.PROBATION):  # a whole probation of drafts that keep nothing
        verify(0)
    assert drafter.stood_down_requests == 1 and drafter.propose(req, 100, 1) == ()
