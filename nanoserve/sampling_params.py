"""Validated `SamplingParams`, mirroring vLLM's offline `SamplingParams` where the two overlap.

Scripts written for vLLM carry over; a value the engine refuses raises `SamplingParamsError`
naming the field and a fix.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from nanoserve.errors import RequestError, shown
from nanoserve.structured.params import StructuredOutputsError, StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "MAX_N", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]

# vLLM treats temperatures below this as greedy: dividing by them overflows float32.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # the engine's default --max-logprobs (vLLM's): alternatives a request may ask for
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_N = 128  # completions per request; each is a sequence with its own KV blocks
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


class SamplingParamsError(RequestError):
    """A sampling parameter the engine refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------
# Validation helpers: each returns the normalised value or raises with a fix.
# ---------------------------------------------------------------------------


def _fail(name: str, message: str) -> NoReturn:
    raise SamplingParamsError(name, message)


def _type_name(value: object) -> str:
    return f"{type(value).__name__} {shown(value)}"


def _as_int(name: str, value: object, example: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    # bool is an int subclass, but max_tokens=True is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if allow_none else "an int"
        raise SamplingParamsError(name, f"{name} must be {kind}, got {_type_name(value)}; pass {example}")
    return int(value)


def _as_float(name: str, value: object, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(name, f"{name} must be a number, got {_type_name(value)}; pass {example}")
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value!r}; pass {example}")
    return value


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral)


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be True or False, got {_type_name(value)}")
    return value


@dataclass
class SamplingParams:
    """How to pick the next token of one request; names and defaults follow vLLM.

    `top_k` of 0 or -1 disables top-k (stored as 0). `stop` is stored as a tuple of
    strings and `stop_token_ids` as a tuple of ints (empty when not given).
    `max_tokens=None` means "up to the model's context length"; the engine fills it in.
    `ignore_eos` only tells the engine not to stop on EOS; the sampler never masks EOS
    for it. `logprobs=N` returns the sampled token's logprob and the top N alternatives
    (0: the sampled token only; -1: the whole vocabulary, as vLLM), computed from the raw model
    logits; `prompt_logprobs=N` does the same for every prompt token after the first. The engine
    holds N to its max_logprobs (20 unless started otherwise). `logprob_token_ids` (vLLM's, up to 128 ids)
    replaces the top N: each position's alternatives are exactly those ids (and the sampled token), with their
    true ranks, which is how a scorer reads a fixed label set; it needs logprobs set.
    `n` completions share the prompt; with a seed, completion i draws with seed + i (vLLM's
    rule), so each is reproducible and they differ from one another.
    `logit_bias` ({token id: bias in [-100, 100]}) is added to the logits before the pick,
    `allowed_token_ids` restricts the pick to those ids, and `bad_words` are never completed.
    `detokenize=False` returns token ids with empty text (stop strings then cannot be used).
    `structured_outputs` (a StructuredOutputsParams, or a dict of its fields) constrains the output to a JSON
    schema, a regex, a choice or a grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logprob_token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        # The order is part of the contract: a request with several bad values is told about the same one
        # first, and later steps read fields earlier ones normalised (stop, max_tokens, ignore_eos).
        self._check_sampling()
        self._check_penalties()
        self._check_seed()
        self._check_lengths()
        self._check_stops()
        self._check_flags()
        self._check_logprobs()
        self._check_token_constraints()
        self._check_structured_outputs()

    def _check_sampling(self) -> None:
        """n and the knobs that shape the distribution a token is drawn from."""
        self.n = _as_int("n", self.n, "1")
        if not 1 <= self.n <= MAX_N:
            _fail("n", f"n must be in [1, {MAX_N}], got {self.n}; ask for at most {MAX_N} completions per request")

        self.temperature = _as_float("temperature", self.temperature, "a float such as 0.7")
        if self.temperature < 0:
            _fail(
                "temperature", f"temperature must be >= 0, got {self.temperature}; use 0 for greedy decoding"
            )

        self.top_p = _as_float("top_p", self.top_p, "a float in (0, 1] such as 0.9")
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")

        self.top_k = _as_int("top_k", self.top_k, "an int such as 50, or 0 to disable")
        if self.top_k < -1:
            _fail(
                "top_k",
                f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}; use 0 to consider all tokens",
            )
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _as_float("min_p", self.min_p, "a float in [0, 1] such as 0.05")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable")

    def _check_penalties(self) -> None:
        """The repetition, presence and frequency penalties, each in the range vLLM accepts."""
        self.repetition_penalty = _as_float(
            "repetition_penalty", self.repetition_penalty, "a float such as 1.1"
        )
        if self.repetition_penalty <= 0:
            _fail(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}; use 1.0 for no penalty",
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name), "a float in [-2, 2] such as 0.5")
            if not -2 <= value <= 2:
                _fail(name, f"{name} must be in [-2, 2], got {value}; use 0 for no penalty")
            setattr(self, name, value)

    def _check_seed(self) -> None:
        self.seed = _as_int(
            "seed", self.seed, "an int such as 42, or None for an unseeded draw", allow_none=True
        )

    def _check_lengths(self) -> None:
        """max_tokens and min_tokens, each alone and then against each other."""
        self.max_tokens = _as_int(
            "max_tokens", self.max_tokens, "a positive int such as 256", allow_none=True
        )
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail(
                "max_tokens",
                f"max_tokens must be >= 1 or None, got {self.max_tokens}; "
                "use None to generate up to the model's context length",
            )

        self.min_tokens = _as_int("min_tokens", self.min_tokens, "a non-negative int such as 0")
        if self.min_tokens < 0:
            _fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}; use 0 for no minimum")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}; raise max_tokens or lower min_tokens",
            )

    def _check_stops(self) -> None:
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

    def _check_flags(self) -> None:
        """The output switches: strict bools, since a truthy string such as "false" would read as True."""
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )

    def _check_logprobs(self) -> None:
        """logprobs and prompt_logprobs: a count of alternatives, -1 for the whole vocabulary, or None."""
        for name in ("logprobs", "prompt_logprobs"):
            value = _as_int(name, getattr(self, name), "an int >= 0 (-1: the whole vocabulary), or None for no "
                                                       "logprobs", allow_none=True)
            if value is not None and value < -1:
                _fail(name, f"{name} must be >= 0, -1 (the whole vocabulary) or None, got {value}; 0 returns only "
                            "the token's own logprob")
            setattr(self, name, value)
        ids = self._normalise_ids("logprob_token_ids", self.logprob_token_ids)
        self.logprob_token_ids = tuple(dict.fromkeys(ids)) if ids else None  # each id once, in the order asked
        if self.logprob_token_ids is None:
            return
        if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            _fail("logprob_token_ids", f"logprob_token_ids lists {len(self.logprob_token_ids)} ids; at most "
                                       f"{MAX_LOGPROB_TOKEN_IDS} are scored (logprobs -1 gives the whole vocabulary)")
        if self.logprobs is None:
            _fail("logprob_token_ids", "logprob_token_ids are scored at each generated position as its logprobs' "
                                       "alternatives, so they need logprobs set too")

    def _check_token_constraints(self) -> None:
        """detokenize (which stop strings need), then what biases or limits the pick: logit_bias,
        allowed_token_ids and bad_words."""
        self.detokenize = _as_bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            _fail("detokenize", "stop strings are matched in text, so they need detokenize=True; "
                                "use stop_token_ids, or turn detokenize on")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalise_ids("allowed_token_ids", self.allowed_token_ids)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            _fail("allowed_token_ids", "allowed_token_ids is empty, so no token could be sampled; "
                                       "list at least one id, or pass None to allow every token")
        self.bad_words = self._normalise_words(self.bad_words)

    def _check_structured_outputs(self) -> None:
        """A StructuredOutputsParams (or a dict of its fields), which must be able to end on its own."""
        try:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        except StructuredOutputsError as e:
            _fail("structured_outputs", str(e))
        if self.structured_outputs is not None and self.ignore_eos:
            _fail("ignore_eos", "ignore_eos would run a structured output past the end its grammar allows; "
                                "drop ignore_eos (max_tokens still bounds the output)")

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamsError(
                "stop",
                f"stop must be a str, a list of str or None, got {_type_name(stop)}; pass e.g. ['\\n\\n']",
            )
        if any(s == "" for s in stop):
            raise SamplingParamsError(
                "stop", f"stop must not contain empty strings, got {shown(list(stop))}; remove the empty string"
            )
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
        return SamplingParams._normalise_ids("stop_token_ids", ids) or ()

    @staticmethod
    def _normalise_ids(name: str, ids: object) -> tuple[int, ...] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or any(_not_int(i) for i in ids):
            raise SamplingParamsError(
                name, f"{name} must be a list of int or None, got {_type_name(ids)}; pass e.g. [128009]"
            )
        bad = [int(i) for i in ids if i < 0]
        if bad:
            raise SamplingParamsError(name, f"{name} must be >= 0, got {bad}; use ids from this model's tokenizer")
        return tuple(int(i) for i in ids)

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        """OpenAI sends the keys as strings of token ids; both forms become {int: float}."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamsError("logit_bias", f"logit_bias must be a dict {{token id: bias}}, got "
                                                    f"{_type_name(bias)}; pass e.g. {{'1234': -100}}")
        def token_of(key):
            return int(key) if isinstance(key, str) and key.strip().isdigit() else key

        bad = [key for key in bias if _not_int(token_of(key)) or token_of(key) < 0]
        if bad:
            names = ", ".join(shown(key) for key in bad)
            raise SamplingParamsError("logit_bias", f"logit_bias key{'s' if len(bad) > 1 else ''} {names} "
                                                    f"{'are' if len(bad) > 1 else 'is'} not a token id; use ids from "
                                                    "this model's tokenizer, e.g. {'1234': -100}")
        out = {}
        for key, value in bias.items():
            token = token_of(key)
            value = _as_float("logit_bias", value, f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise SamplingParamsError("logit_bias", f"logit_bias[{key!r}] is {value}; biases must be in "
                                                        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            out[int(token)] = value
        return out or None

    @staticmethod
    def _normalise_words(words: object) -> tuple[str, ...] | None:
        if words is None:
            return None
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w for w in words):
            raise SamplingParamsError("bad_words", f"bad_words must be a list of non-empty strings, got "
                                                   f"{_type_name(words)}; pass e.g. ['darn']")
        return tuple(words)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or so small it would overflow)."""
        return self.temperature < _GREEDY_EPS

    def validate_against(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """These params for one model: token ids (stop_token_ids, logit_bias, allowed_token_ids) it can never
        produce are refused, and logprobs -1 becomes its vocabulary; logprobs past `max_logprobs` (-1: no limit)
        are refused, as vLLM's --max-logprobs does."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logprob_token_ids", self.logprob_token_ids or ())):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise SamplingParamsError(
                    name,
                    f"{name} {bad} are outside this model's vocabulary [0, {vocab_size}); "
                    "use ids from this model's tokenizer",
                )
        resolved = {}
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if name == "logprobs" and self.logprob_token_ids:  # the ids replace the top N (vLLM's precedence)
                resolved[name] = 0
                continue
            wanted = vocab_size if asked == -1 else asked
            if wanted is not None and max_logprobs != -1 and wanted > max_logprobs:
                what = f"{name} -1 asks for the whole vocabulary ({vocab_size} tokens)" if asked == -1 else \
                    f"{name} {asked} asks for more alternatives"
                raise SamplingParamsError(name, f"{what} than this server returns (--max-logprobs {max_logprobs}); "
                                                f"ask for at most {max_logprobs}, or start it with a higher "
                                                "--max-logprobs (-1: no limit)")
            if asked == -1:
                resolved[name] = wanted
        return dataclasses.replace(self, **resolved) if resolved else self

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion `index` of n: one sequence, seeded seed + index when a seed is set."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
