"""Tests for nanoserve.sampling against independent float64 numpy oracles."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from nanoserve.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SampleResult,
    SamplingParams,
    SamplingParamsError,
    SamplingRow,
    TokenLogprobs,
)

# Upper 1e-4 tail of chi-square with 9 degrees of freedom (10-token vocabularies).
CHI2_DF9_P1E4 = 33.72


def row(prompt=(), output=(), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), frozenset(eos))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def np_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z[np.isfinite(z)].max()
    e = np.exp(z)
    return e / e.sum()


def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max()
    return z - m - np.log(np.exp(z - m).sum())


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------

INVALID = [
    ("n", 129),
    ("n", 0),
    ("n", "1"),
    ("n", True),
    ("temperature", -1.0),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", "0"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", "1"),
    ("seed", "1"),
    ("seed", 1.0),
    ("seed", True),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", True),
    ("max_tokens", 1.5),
    ("max_tokens", "16"),
    ("min_tokens", -1),
    ("min_tokens", True),
    ("min_tokens", None),
    ("stop", ""),
    ("stop", ["a", ""]),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("stop", {"a"}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", [True]),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", 0),
    ("logprobs", -2),  # -1 is the whole vocabulary; how many the engine returns is its max_logprobs
    ("logprobs", True),
    ("logprobs", 2.0),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_the_field(name, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name
    message = str(info.value)
    assert name in message
    assert repr(value) in message or f"n={value}" in message
    assert isinstance(info.value, ValueError)


def test_min_tokens_above_max_tokens():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(min_tokens=20, max_tokens=10)
    assert info.value.field == "min_tokens"
    assert "min_tokens=20" in str(info.value) and "max_tokens=10" in str(info.value)


def test_messages_say_the_fix():
    with pytest.raises(SamplingParamsError, match=r"temperature must be >= 0, got -1.0; use 0 for greedy"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingParamsError, match=r"n must be in \[1, 128\], got 0; ask for at most 128"):
        SamplingParams(n=0)
    with pytest.raises(SamplingParamsError, match=r"got bool True"):
        SamplingParams(max_tokens=True)


VALID = [
    {},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 1e-6},
    {"temperature": 2},
    {"temperature": np.float32(0.5)},
    {"top_p": 1e-9},
    {"top_p": 1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**6},
    {"min_p": 0},
    {"min_p": 1},
    {"repetition_penalty": 1e-3},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"seed": 0},
    {"seed": -5},
    {"seed": 2**70},
    {"max_tokens": None},
    {"max_tokens": 1},
    {"max_tokens": np.int64(5)},
    {"min_tokens": 16, "max_tokens": 16},
    {"min_tokens": 1000, "max_tokens": None},
    {"stop": []},
    {"stop_token_ids": []},
    {"stop_token_ids": [0, 2]},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_valid_edge_values_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(params, name) == value


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == (
        False,
        None,
        True,
        False,
    )


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)
    assert type(SamplingParams(temperature=1).temperature) is float
    # Re-validation through dataclasses.replace keeps normalised values valid.
    p = dataclasses.replace(SamplingParams(stop="x", top_k=-1), max_tokens=None)
    assert (p.stop, p.top_k, p.max_tokens) == (("x",), 0, None)


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


def test_validate_against_vocab():
    SamplingParams(stop_token_ids=[0, 31999]).validate_against(32000)
    with pytest.raises(SamplingParamsError, match=r"\[40000\].*\[0, 32000\)") as info:
        SamplingParams(stop_token_ids=[5, 40000]).validate_against(32000)
    assert info.value.field == "stop_token_ids"


# ---------------------------------------------------------------------------
# Greedy and penalties
# ---------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = torch.randn(16, 1000, generator=gen(0))
    result = Sampler()(logits, [row(temperature=0) for _ in range(16)])
    assert isinstance(result, SampleResult)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 16


def test_greedy_rows_in_mixed_batch_equal_argmax():
    logits = torch.randn(6, 500, generator=gen(1))
    rows = [row(temperature=0 if i % 2 == 0 else 0.8, top_k=20, seed=i) for i in range(6)]
    tokens = Sampler(gen(2))(logits, rows).token_ids
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_plain_greedy_batch_takes_fast_path(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("plain greedy batch must not process logits")

    monkeypatch.setattr(Sampler, "process_logits", boom)
    logits = torch.randn(4, 50, generator=gen(3))
    assert Sampler()(logits, [row(temperature=0) for _ in range(4)]).token_ids == logits.argmax(-1).tolist()


def test_input_logits_not_modified():
    logits = torch.randn(3, 40, generator=gen(4))
    before = logits.clone()
    rows = [
        row(prompt=[1, 2], output=[3], repetition_penalty=1.5, frequency_penalty=1.0, temperature=0),
        row(output=[5], min_tokens=3, eos={7}, top_p=0.5, seed=1),
        row(top_k=3, min_p=0.1, logprobs=2),
    ]
    Sampler(gen(0))(logits, rows)
    assert torch.equal(logits, before)


def repetition_oracle(logits: np.ndarray, ids: list[int], penalty: float) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in set(ids):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def openai_penalty_oracle(
    logits: np.ndarray, output: list[int], presence: float, frequency: float
) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in set(output):
        count = output.count(t)
        out[t] -= count * frequency + presence
    return out


def test_repetition_penalty_matches_transformers_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 64)).astype(np.float32) * 3
    histories = [([1, 2, 3, 3], [4, 5, 1]), ([], [10, 11, 10]), ([60, 61, 62, 63], [])]
    penalties = [1.3, 0.7, 2.0]
    rows = [
        row(p, o, repetition_penalty=r, temperature=0) for (p, o), r in zip(histories, penalties, strict=True)
    ]
    got = Sampler().process_logits(torch.from_numpy(logits), rows).numpy()
    for i, ((prompt, output), penalty) in enumerate(zip(histories, penalties, strict=True)):
        expected = repetition_oracle(logits[i], prompt + output, penalty)
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5]])
    [token] = Sampler()(logits, [row([0], [], repetition_penalty=2.0, temperature=0)]).token_ids
    expected = int(np.argmax(repetition_oracle(logits[0].numpy(), [0], 2.0)))
    assert token == expected == 1


def test_presence_and_frequency_penalties_match_openai_formula():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 32)).astype(np.float32)
    outputs = [[3, 3, 3, 7, 9, 9], [0, 31]]
    settings = [(0.5, 0.25), (-1.0, 2.0)]
    rows = [
        row([20, 21], o, presence_penalty=pp, frequency_penalty=fp, temperature=0)
        for o, (pp, fp) in zip(outputs, settings, strict=True)
    ]
    got = Sampler().process_logits(torch.from_numpy(logits), rows).numpy()
    for i, (output, (presence, frequency)) in enumerate(zip(outputs, settings, strict=True)):
        # Prompt tokens 20 and 21 carry no OpenAI penalty.
        expected = openai_penalty_oracle(logits[i], output, presence, frequency)
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6)


def test_all_penalties_compose_repetition_first():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1, 16)).astype(np.float32) * 2
    prompt, output = [1, 2], [2, 3, 3]
    rows = [row(prompt, output, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)]
    got = Sampler().process_logits(torch.from_numpy(logits), rows).numpy()[0]
    expected = openai_penalty_oracle(repetition_oracle(logits[0], prompt + output, 1.5), output, 0.3, 0.2)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# min_tokens and ignore_eos
# ---------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 10.0  # eos is the favourite
    logits[0, 7] = 9.0  # then a stop token
    sampler = Sampler()

    def step(n_out: int, **params):
        return row(output=[1] * n_out, eos={5}, min_tokens=3, stop_token_ids=[7], temperature=0, **params)

    masked = sampler.process_logits(logits, [step(2)])[0]
    assert masked[5] == -math.inf and masked[7] == -math.inf
    assert torch.isfinite(masked[[0, 1, 2, 3, 4, 6, 8, 9]]).all()
    assert sampler(logits, [step(0)]).token_ids == [0]
    assert sampler(logits, [step(3)]).token_ids == [5]


def test_ignore_eos_never_masks_eos():
    logits = torch.zeros(2, 10)
    logits[:, 5] = 10.0
    logits[:, 7] = 9.0
    rows = [
        row(output=[], eos={5}, ignore_eos=True, temperature=0),
        row(output=[], eos={5}, ignore_eos=True, min_tokens=4, stop_token_ids=[7], temperature=0),
    ]
    processed = Sampler().process_logits(logits, rows)
    assert torch.equal(processed[0], logits[0])
    # min_tokens still holds back the explicit stop ids; eos is the engine's business.
    assert processed[1, 5] == 10.0 and processed[1, 7] == -math.inf
    assert Sampler()(logits, rows).token_ids == [5, 5]


# ---------------------------------------------------------------------------
# Temperature, top-k, top-p, min-p
# ---------------------------------------------------------------------------


def filter_oracle(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """float64 kept set and normalised distribution: temperature, top-k, top-p, min-p in order."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(z.shape, dtype=bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        probs = np_softmax(np.where(keep, z, -np.inf))
        sorted_probs = probs[order]
        mass_above = np.cumsum(sorted_probs) - sorted_probs
        # Guard the oracle itself: a boundary within float32 rounding would make the test fragile.
        assert np.min(np.abs(mass_above[1:] - top_p)) > 1e-4
        drop = mass_above >= top_p
        drop[0] = False
        keep[order[drop]] = False
    if min_p > 0:
        probs = np_softmax(np.where(keep, z, -np.inf))
        keep &= probs >= min_p * probs.max()
    return keep, np_softmax(np.where(keep, z, -np.inf))


FILTERS = [
    dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=0, top_p=0.6, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_k=1, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("cfg", FILTERS, ids=[repr(c) for c in FILTERS])
def test_filtered_distribution_matches_float64_oracle(cfg):
    logits = np.random.default_rng(5).normal(size=40).astype(np.float32) * 2
    keep, expected = filter_oracle(logits, **cfg)
    assert 1 <= keep.sum() < 40
    got = Sampler().probs(torch.from_numpy(logits)[None], [row(**cfg)])[0].numpy()
    np.testing.assert_array_equal(got > 0, keep)
    np.testing.assert_allclose(got, expected, atol=1e-5)

    # Many draws never leave the kept set, and every kept token shows up.
    n = 4000
    batch = torch.from_numpy(logits)[None].expand(n, -1)
    tokens = np.array(Sampler(gen(6))(batch, [row(**cfg)] * n).token_ids)
    assert keep[tokens].all()
    if keep.sum() <= 10:
        assert set(tokens.tolist()) == set(np.flatnonzero(keep).tolist())


PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


# The first batch needs a full sort (top_p without top_k); the second only the top-k head,
# and its rows without top_k must keep their whole tail.
@pytest.mark.parametrize(
    "configs", [FILTERS + [PLAIN], [FILTERS[0], PLAIN, FILTERS[3], FILTERS[2]]], ids=["full", "head"]
)
def test_filters_are_per_row_in_one_batch(configs):
    logits = np.random.default_rng(7).normal(size=(len(configs), 40)).astype(np.float32) * 2
    rows = [row(**cfg) for cfg in configs]
    got = Sampler().probs(torch.from_numpy(logits), rows).numpy()
    for i, cfg in enumerate(configs):
        keep, expected = filter_oracle(logits[i], **cfg)
        np.testing.assert_array_equal(got[i] > 0, keep)
        np.testing.assert_allclose(got[i], expected, atol=1e-5)


def record_sorts(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Patch Tensor.sort / topk / argmax to log (name, input shape) of every call."""
    calls = []
    for name in ("sort", "topk", "argmax"):
        original = getattr(torch.Tensor, name)

        def logged(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, tuple(self.shape)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, logged)
    return calls


def test_only_top_p_rows_without_top_k_pay_a_full_sort(monkeypatch):
    vocab = 300
    logits = torch.randn(5, vocab, generator=gen(15))
    rows = [
        row(temperature=0.8, seed=1),
        row(top_k=5, seed=2),
        row(top_p=0.9, seed=3),
        row(temperature=0),
        row(top_k=3, top_p=0.5, seed=4),
    ]
    calls = record_sorts(monkeypatch)
    Sampler()(logits, rows)
    # One full sort for the single top_p-only row; one topk over the two top_k rows.
    assert [c for c in calls if c[0] != "argmax"] == [("topk", (2, vocab)), ("sort", (1, vocab))]

    calls.clear()
    Sampler()(logits[[0, 1, 3]], [rows[0], rows[1], rows[3]])
    assert [c for c in calls if c[0] != "argmax"] == [("topk", (1, vocab))]

    calls.clear()
    Sampler()(logits[:2], [rows[0], rows[0]])
    assert [c for c in calls if c[0] != "argmax"] == []


def test_all_greedy_batch_costs_one_argmax(monkeypatch):
    logits = torch.randn(4, 50, generator=gen(16))
    calls = record_sorts(monkeypatch)
    tokens = Sampler()(logits, [row(temperature=0) for _ in range(4)]).token_ids
    assert calls == [("argmax", (4, 50))]
    assert tokens == logits.argmax(-1).tolist()


def test_temperature_sampling_frequencies_match_softmax():
    logits = np.linspace(-1.5, 1.5, 10).astype(np.float32)
    temperature = 0.7
    expected = np_softmax(logits.astype(np.float64) / temperature)
    n = 20000
    batch = torch.from_numpy(logits)[None].expand(n, -1)
    tokens = Sampler(gen(8))(batch, [row(temperature=temperature)] * n).token_ids
    counts = np.bincount(tokens, minlength=10)
    assert chi_square(counts, expected) < CHI2_DF9_P1E4


def test_seeded_draws_follow_the_distribution():
    # Each row has its own derived generator; across seeds the draws must still be unbiased.
    logits = np.linspace(-1.0, 1.0, 10).astype(np.float32)
    expected = np_softmax(logits.astype(np.float64))
    n = 3000
    batch = torch.from_numpy(logits)[None].expand(n, -1)
    tokens = Sampler()(batch, [row(seed=s) for s in range(n)]).token_ids
    assert chi_square(np.bincount(tokens, minlength=10), expected) < CHI2_DF9_P1E4


def test_filtered_sampling_frequencies_match_oracle():
    logits = np.random.default_rng(9).normal(size=30).astype(np.float32)
    cfg = dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1)
    keep, expected = filter_oracle(logits, **cfg)
    n = 20000
    batch = torch.from_numpy(logits)[None].expand(n, -1)
    tokens = Sampler(gen(10))(batch, [row(**cfg)] * n).token_ids
    counts = np.bincount(tokens, minlength=30)
    assert counts[~keep].sum() == 0
    stat = chi_square(counts[keep], expected[keep])
    assert keep.sum() <= 10 and stat < CHI2_DF9_P1E4


# ---------------------------------------------------------------------------
# Reproducibility
# ---------------------------------------------------------------------------


def fake_logits(history: list[int], vocab: int = 200) -> torch.Tensor:
    """Deterministic stand-in for a model: flat-ish logits that depend on the history."""
    rng = np.random.default_rng(len(history) * 7919 + sum(history))
    return torch.from_numpy(rng.normal(size=vocab).astype(np.float32) * 0.5)


def test_seeded_row_independent_of_batch_composition_and_order():
    target = row(prompt=[1, 2, 3], output=[4, 5], seed=1234, temperature=0.9, top_p=0.95)
    logits = fake_logits([1, 2, 3, 4, 5])
    others = [
        (row(seed=7, temperature=1.2), torch.randn(200, generator=gen(11))),
        (row(temperature=0.5), torch.randn(200, generator=gen(12))),
        (row(temperature=0), torch.randn(200, generator=gen(13))),
        (row(seed=1234, output=[9], top_k=3), torch.randn(200, generator=gen(14))),
    ]
    layouts = [[], [0], [1, 2], [3, 0, 1, 2]]
    seen = set()
    for layout in layouts:
        for position in range(len(layout) + 1):
            batch = [others[j] for j in layout]
            batch.insert(position, (target, logits))
            rows = [r for r, _ in batch]
            result = Sampler(gen(position))(torch.stack([lg for _, lg in batch]), rows)
            seen.add(result.token_ids[position])
    assert len(seen) == 1


def generate(seed: int | None, steps: int, sampler: Sampler, history=None, companions=0) -> list[int]:
    prompt = [11, 12, 13]
    output = list(history or [])
    while len(output) < steps:
        rows = [row(prompt, output, seed=seed, temperature=1.0)]
        logits = [fake_logits(prompt + output)]
        for c in range(companions):
            rows.append(row(seed=None if c % 2 else c, temperature=0.7))
            logits.append(torch.randn(200, generator=gen(len(output) * 31 + c)))
        output.append(sampler(torch.stack(logits), rows).token_ids[0])
    return output


def test_seeded_stream_survives_preemption_and_recompute():
    full = generate(42, 8, Sampler())
    # Preempted after 3 tokens and recomputed later by another sampler, in a busier batch.
    resumed = generate(42, 8, Sampler(gen(99)), history=full[:3], companions=3)
    assert resumed == full
    assert generate(42, 8, Sampler(), companions=2) == full


MIXED = [
    dict(temperature=0.8),
    dict(top_k=5),
    dict(top_p=0.9),
    dict(temperature=0),
    dict(top_k=40, top_p=0.7, temperature=1.2),
    dict(top_p=0.5, min_p=0.05),
    dict(top_k=2, repetition_penalty=1.3, frequency_penalty=0.5),
    dict(temperature=0, presence_penalty=1.0),
    dict(min_p=0.1, temperature=0.6),
]


@pytest.mark.parametrize("step", [0, 1, 5])
def test_mixed_batch_gives_each_row_the_token_it_gets_alone(step):
    # Every filter group (none, top_k head, full sort for top_p) and greedy rows in one
    # batch: grouping the sorts must not change any row's distribution or draw.
    vocab = 400
    logits = torch.randn(len(MIXED), vocab, generator=gen(17 + step)) * 2
    rows = [
        row(prompt=[1, 2, 3], output=list(range(10, 10 + step)), seed=100 + i, **cfg)
        for i, cfg in enumerate(MIXED)
    ]
    together = Sampler()(logits, rows).token_ids
    alone = [Sampler()(logits[i : i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]
    assert together == alone
    probs = Sampler().probs(logits, rows)
    for i, r in enumerate(rows):
        assert torch.equal(probs[i], Sampler().probs(logits[i : i + 1], [r])[0])


def test_different_seeds_give_different_streams():
    streams = [tuple(generate(seed, 6, Sampler())) for seed in range(6)]
    assert len(set(streams)) == len(streams)
    # Seed s at step k is not seed s+1 at step k-1 (the step is mixed in, not added).
    assert streams[0][1:] != streams[1][:-1]


def test_seed_and_step_are_mixed_not_added():
    # On flat logits the token is a function of the row's noise alone, so equal
    # tokens along (s, k) ~ (s + 1, k - 1) would expose a seed + step derivation.
    vocab = 1000
    tokens = {}
    for seed in range(6):
        rows = [row(output=[0] * step, seed=seed) for step in range(6)]
        for step, token in enumerate(Sampler()(torch.zeros(6, vocab), rows).token_ids):
            tokens[seed, step] = token
    shifted = [tokens[s, k] == tokens[s + 1, k - 1] for s in range(5) for k in range(1, 6)]
    assert sum(shifted) <= 1
    assert len(set(tokens.values())) > 30


def test_unseeded_rows_sample_and_follow_default_generator():
    logits = torch.zeros(64, 100)
    rows = [row() for _ in range(64)]
    first = Sampler(gen(5))(logits, rows).token_ids
    assert len(set(first)) > 20
    assert Sampler(gen(5))(logits, rows).token_ids == first
    assert Sampler(gen(6))(logits, rows).token_ids != first
    torch.manual_seed(3)
    global_a = Sampler()(logits, rows).token_ids
    torch.manual_seed(3)
    assert Sampler()(logits, rows).token_ids == global_a


def test_bad_shapes_and_generator_device_are_refused():
    with pytest.raises(ValueError, match="one row per SamplingRow"):
        Sampler()(torch.zeros(2, 10), [row()])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="default_generator"):
            Sampler(torch.Generator(device="cuda"))(torch.zeros(1, 10), [row()])


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    rng = np.random.default_rng(15)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    rows = [
        row(logprobs=5, temperature=0),
        row([1, 2], [3], logprobs=0, repetition_penalty=1.8, temperature=0.6, seed=3),
        row(logprobs=None),
        row(logprobs=MAX_LOGPROBS, top_k=4, seed=4),
    ]
    result = Sampler(gen(16))(torch.from_numpy(logits), rows)
    assert result.logprobs[2] is None
    for i in (0, 1, 3):
        lp = result.logprobs[i]
        assert isinstance(lp, TokenLogprobs)
        oracle = np_log_softmax(logits[i])
        assert lp.token_id == result.token_ids[i]
        assert lp.logprob == pytest.approx(oracle[lp.token_id], abs=1e-4)
        n = rows[i].params.logprobs
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == np.argsort(-oracle, kind="stable")[:n].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(oracle)[::-1][:n], atol=1e-4)


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_semantics():
    logits = torch.randn(8, 32000, generator=gen(17)).cuda()
    greedy = Sampler()(logits, [row(temperature=0) for _ in range(8)])
    assert greedy.token_ids == logits.argmax(-1).tolist()

    target = row([1, 2], [3], seed=77, top_p=0.9, repetition_penalty=1.2, logprobs=3)
    alone = Sampler()(logits[:1], [target]).token_ids[0]
    rows = [row(seed=i, top_k=50) for i in range(7)]
    mixed = Sampler(torch.Generator(device="cuda").manual_seed(0))(
        logits.roll(3, 0), rows[:3] + [target] + rows[3:]
    )
    assert mixed.token_ids[3] == alone
    keep, _ = filter_oracle(logits[0].cpu().numpy(), temperature=1.0, top_k=50, top_p=1.0, min_p=0.0)
    batch = logits[:1].expand(2000, -1)
    tokens = Sampler()(batch, [row(top_k=50) for _ in range(2000)]).token_ids
    assert keep[np.array(tokens)].all()
