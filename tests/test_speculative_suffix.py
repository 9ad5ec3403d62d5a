"""Suffix decoding (speculative/suffix.py): the most frequent continuation of a matched suffix, from the request's
own tokens and from recent requests' outputs, checked against a plain search that compares every window; and,
through the engine, outputs byte-identical to decoding without speculation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError
from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.speculative.suffix import END, OutputCache, SuffixProposer, SuffixSearch

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def _every_window(tokens, cached, k, depth, factor, min_prob):
    """The reference: every match length of every source, its occurrences found by comparing every window, the
    path counted token by token; sources in order (own tokens, then the cache), lengths longest first, the first
    best score kept."""
    own = [*tokens, END]
    flat = [END]
    for output in cached:
        flat += [*output, END]
    best, best_score = [], 0.0
    for corpus, first, last in ((own, 1, len(tokens) - 1), (flat, 2, len(flat))):
        if corpus is flat and not cached:
            continue
        found = []
        for m in range(first, min(depth, len(tokens)) + 1):
            ends = [e for e in range(m - 1, last) if corpus[e - m + 1:e + 1] == tokens[-m:]]
            if not ends:
                break
            found.append((m, [e + 1 for e in ends]))
        for m, nxt in reversed(found):
            limit = max(0, min(k, int(m * factor + 1e-6), depth - m))
            if limit <= best_score:
                continue
            path, prob, score = [], 1.0, 0.0
            while len(path) < limit:
                values = [corpus[p] for p in nxt]
                counts = Counter(values)
                top = max(counts.values())
                token = next(v for v in reversed(values) if counts[v] == top)
                if token == END or prob * top / len(nxt) < min_prob:
                    break
                prob *= top / len(nxt)
                path.append(token)
                score += prob
                nxt = [p + 1 for p in nxt if corpus[p] == token]
            if score > best_score:
                best, best_score = path, score
    return best[:k]


def test_suffix_search_agrees_with_comparing_every_window():
    rng = random.Random(1)
    for _ in range(1500):
        depth, k = rng.randrange(2, 10), rng.randrange(1, 8)
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.5])
        proposer = SuffixProposer(SuffixSearch(depth, factor, min_prob), 5)
        cached = [[rng.randrange(4) for _ in range(rng.randrange(2, 15))] for _ in range(rng.randrange(3))]
        for output in cached:
            proposer.finished(output)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        assert proposer.propose(tokens, k) == _every_window(tokens, cached, k, depth, factor, min_prob), \
            (tokens, cached, k, depth, factor, min_prob)


def test_the_most_frequent_continuation_wins_and_a_long_match_earns_a_long_draft():
    search = SuffixSearch(24, 1.0, 0.1)
    proposer = SuffixProposer(search, 0)
    # after "1 2": "3" twice, "4" once (the latest): frequency beats recency, unlike prompt lookup
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2], 1) == [3]
    # a one-token match may draft one token (max_spec_factor 1); a six-token match six
    assert proposer.propose([5, 6, 7, 8, 9, 10, 11, 12, 0, 5], 8) == [6]
    assert proposer.propose([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 5, 6, 7, 8, 9, 10], 8) == \
        [11, 12, 13, 14, 15, 0]
    # a continuation below min_token_prob is not drafted: four ways on after "1", each a quarter
    assert SuffixProposer(SuffixSearch(24, 4.0, 0.3), 0).propose([1, 2, 1, 3, 1, 4, 1, 5, 1], 3) == []


def test_recent_outputs_give_drafts_to_a_request_that_has_no_repeats_of_its_own():
    proposer = SuffixProposer(SuffixSearch(24, 1.0, 0.1), 2)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    assert proposer.propose([1, 2, 40, 41, 42], 4) == []
    proposer.finished(answer)
    assert proposer.propose([1, 2, 40, 41, 42], 4) == [43, 44, 45]  # a match of 3 drafts up to 3


def test_the_output_cache_keeps_the_latest_requests_and_forgets_the_evicted():
    cache = OutputCache(2)
    for i in range(7):  # each output unique to its request: (100 i, 100 i + 1, ...)
        cache.add([100 * i + j for j in range(5)])
    assert len(cache) == 2
    for i in range(7):
        found = cache.occurrences(100 * i, 100 * i + 1)
        assert found.size == (1 if i >= 5 else 0), i
        if found.size:
            assert cache.corpus[found[0] + 1] == 100 * i + 2
    assert cache.corpus.shape[0] <= 4 * 6 + 1  # evicted outputs are dropped once they are half the array
    off = OutputCache(0)
    off.add([1, 2, 3])
    assert len(off) == 0 and off.occurrences(1, 2).size == 0


def test_suffix_keys_follow_vllm_and_foreign_keys_are_refused():
    config = SpeculativeConfig.parse({"method": "suffix"})
    assert config.num_speculative_tokens == 16  # vLLM's default (the tree depth, 24), capped at what a step verifies
    assert config.as_dict() == {"method": "suffix", "num_speculative_tokens": 16,
                                "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                                "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
    assert SpeculativeConfig.parse(config.as_json()) == config
    for value, says in (({"method": "suffix", "prompt_lookup_max": 3}, "do not apply to method 'suffix'"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
                         "do not apply to method 'ngram'"),
                        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, r"\[0, 1\]"),
                        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "> 0"),
                        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ">= 1")):
        with pytest.raises(ConfigError, match=says):
            SpeculativeConfig.parse(value)


def test_suffix_outputs_are_byte_identical_and_later_requests_draft_from_earlier_outputs(tiny_checkpoint):
    """Prompts without repeats of their own: the first round drafts little; the same prompts again draft from
    the first round's outputs and keep most of it. Greedy and seeded outputs are those of the engine without
    speculation, every round."""
    path = str(tiny_checkpoint("llama"))
    base = LLM(model=path, max_model_len=512, kv_cache_gib=0.02)
    spec = LLM(model=path, max_model_len=512, kv_cache_gib=0.02, speculative_config=SUFFIX)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(12)] for _ in range(3)]
    kept = []
    for params in (SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=1.0, seed=11, max_tokens=32, ignore_eos=True)):
        want = [(o.token_ids, o.text, o.logprobs) for r in base.generate(prompts, params, use_tqdm=False)
                for o in r.outputs]
        got = [(o.token_ids, o.text, o.logprobs) for r in spec.generate(prompts, params, use_tqdm=False)
               for o in r.outputs]
        assert got == want
        kept.append(spec.engine.stats().features["speculative"]["num_accepted_tokens"])
    counters = spec.engine.stats().features["speculative"]
    assert counters["method"] == "suffix" and counters["cached_requests"] == 9
    assert kept[1] - kept[0] > 2 * kept[0] + 20, kept  # the repeated round copies the first round's outputs
