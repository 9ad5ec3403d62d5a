"""Sampling parameters and the batched sampler that turns logits into next tokens.

`SamplingParams` mirrors vLLM's offline `SamplingParams` where the two overlap, so
scripts written for vLLM carry over. `Sampler` applies, in the order vLLM and
transformers use: repetition penalty, presence/frequency penalties, min_tokens
masking, then argmax for greedy rows, or temperature, top-k, top-p, min-p and a
random draw for the others.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from nanoserve.errors import RequestError

__all__ = [
    "MAX_LOGPROBS",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingRow",
    "TokenLogprobs",
]

# vLLM treats temperatures below this as greedy: dividing by them overflows float32.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_MASK64 = (1 << 64) - 1


class SamplingParamsError(RequestError):
    """A sampling parameter the engine refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------
# Validation helpers: each returns the normalised value or raises with a fix.
# ---------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


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


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be True or False, got {_type_name(value)}")
    return value


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_seed(seed: int, step: int) -> int:
    """Seed for a row's draw at `step`; mixed so that (s, k) and (s + 1, k - 1) are unrelated."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


# ---------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """How to pick the next token of one request; names and defaults follow vLLM.

    `top_k` of 0 or -1 disables top-k (stored as 0). `stop` is stored as a tuple of
    strings and `stop_token_ids` as a tuple of ints (empty when not given).
    `max_tokens=None` means "up to the model's context length"; the engine fills it in.
    `ignore_eos` only tells the engine not to stop on EOS; the sampler never masks EOS
    for it. `logprobs=N` returns the sampled token's logprob and the top N alternatives
    (0: the sampled token only), computed from the raw model logits.
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

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise SamplingParamsError(name, message)

        self.n = _as_int("n", self.n, "1")
        if self.n < 1:
            fail("n", f"n must be 1, got {self.n}; use n=1 for one completion per request")
        if self.n > 1:
            fail("n", f"n={self.n} is not supported yet; send n separate requests")

        self.temperature = _as_float("temperature", self.temperature, "a float such as 0.7")
        if self.temperature < 0:
            fail(
                "temperature", f"temperature must be >= 0, got {self.temperature}; use 0 for greedy decoding"
            )

        self.top_p = _as_float("top_p", self.top_p, "a float in (0, 1] such as 0.9")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")

        self.top_k = _as_int("top_k", self.top_k, "an int such as 50, or 0 to disable")
        if self.top_k < -1:
            fail(
                "top_k",
                f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}; use 0 to consider all tokens",
            )
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _as_float("min_p", self.min_p, "a float in [0, 1] such as 0.05")
        if not 0 <= self.min_p <= 1:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable")

        self.repetition_penalty = _as_float(
            "repetition_penalty", self.repetition_penalty, "a float such as 1.1"
        )
        if self.repetition_penalty <= 0:
            fail(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}; use 1.0 for no penalty",
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name), "a float in [-2, 2] such as 0.5")
            if not -2 <= value <= 2:
                fail(name, f"{name} must be in [-2, 2], got {value}; use 0 for no penalty")
            setattr(self, name, value)

        self.seed = _as_int(
            "seed", self.seed, "an int such as 42, or None for an unseeded draw", allow_none=True
        )

        self.max_tokens = _as_int(
            "max_tokens", self.max_tokens, "a positive int such as 256", allow_none=True
        )
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(
                "max_tokens",
                f"max_tokens must be >= 1 or None, got {self.max_tokens}; "
                "use None to generate up to the model's context length",
            )

        self.min_tokens = _as_int("min_tokens", self.min_tokens, "a non-negative int such as 0")
        if self.min_tokens < 0:
            fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}; use 0 for no minimum")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens",
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}; raise max_tokens or lower min_tokens",
            )

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )

        self.logprobs = _as_int(
            "logprobs",
            self.logprobs,
            f"an int in [0, {MAX_LOGPROBS}], or None for no logprobs",
            allow_none=True,
        )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}; "
                f"ask for at most {MAX_LOGPROBS} alternatives (0 returns only the sampled token's logprob)",
            )

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
                "stop", f"stop must not contain empty strings, got {list(stop)!r}; remove the empty string"
            )
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids
        ):
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids must be a list of int or None, got {_type_name(ids)}; pass e.g. [128009]",
            )
        bad = [int(i) for i in ids if i < 0]
        if bad:
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids must be >= 0, got {bad}; use ids from this model's tokenizer",
            )
        return tuple(int(i) for i in ids)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or so small it would overflow)."""
        return self.temperature < _GREEDY_EPS

    def validate_against(self, vocab_size: int) -> None:
        """Refuse stop_token_ids that this model can never produce."""
        bad = [i for i in self.stop_token_ids if i >= vocab_size]
        if bad:
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids {bad} are outside this model's vocabulary [0, {vocab_size}); "
                "use ids from this model's tokenizer",
            )


# ---------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """One row of a batch: its parameters and the history penalties and seeding need.

    `output_ids` are the tokens generated so far; their count is the step used to seed
    the row's draw. `eos_token_ids` are masked (with `params.stop_token_ids`) while fewer
    than `params.min_tokens` tokens have been generated, unless `params.ignore_eos`.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SampleResult:
    """Per row: the next token, and its logprobs when the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_mask(row: SamplingRow) -> set[int]:
    """Token ids that must not be sampled yet because min_tokens has not been reached."""
    p = row.params
    if len(row.output_ids) >= p.min_tokens:
        return set()
    banned = set(p.stop_token_ids)
    if not p.ignore_eos:
        banned.update(row.eos_token_ids)
    return banned


def _flat_ids(
    histories: list[Iterable[int]], rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """Distinct positions (row * vocab + token) of the histories in a flattened [rows, vocab] tensor.

    Ids past the logits width cannot be produced by the model and are dropped.
    """
    ids, owners = [], []
    for history, r in zip(histories, rows, strict=True):
        before = len(ids)
        ids.extend(history)
        owners.extend([r] * (len(ids) - before))
    ids_t = torch.tensor(ids, dtype=torch.long)
    flat = torch.tensor(owners, dtype=torch.long) * vocab + ids_t
    return flat[(ids_t >= 0) & (ids_t < vocab)].to(device)


class Sampler:
    """Picks one next token per row of a [rows, vocab] logits batch.

    Seeded rows are reproducible: the draw for a row with seed s after k generated
    tokens uses a generator seeded from (s, k) alone. A generator kept alive across
    steps would make the stream depend on the history of the sampler rather than of
    the request: a preempted request that is recomputed, or a request whose earlier
    steps ran in another batch, would draw different numbers. Deriving it each step
    makes the token a function of (seed, k, logits) only, whoever shares the batch.

    Unseeded rows draw from `default_generator` when given (it must live on the
    logits' device), else from torch's global generator for that device, so
    `torch.manual_seed` makes a whole run repeatable.
    """

    def __init__(self, default_generator: torch.Generator | None = None):
        self.default_generator = default_generator
        # One scratch generator per device, re-seeded for every seeded row.
        self._scratch: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Sample one token per row; `logits` is never modified."""
        self._check(logits, rows)
        n = len(rows)
        want_logprobs = [r.params.logprobs is not None for r in rows]
        # Fast path: plain greedy batch, one argmax on the raw logits.
        if all(r.params.greedy and not _needs_penalties(r.params) and not _min_tokens_mask(r) for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            processed = self.process_logits(logits, rows)
            tokens = processed.argmax(dim=-1)
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            if sampled:
                idx = torch.tensor(sampled, device=logits.device)
                probs = self._filtered_probs(processed[idx], [rows[i].params for i in sampled])
                tokens[idx] = self._draw(probs, [rows[i] for i in sampled])
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        if any(want_logprobs):
            logprobs = self._logprobs(logits, rows, token_ids)
        return SampleResult(token_ids=token_ids, logprobs=logprobs)

    # -- stages, public so that tests and debugging can see each distribution --

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Logits after penalties and min_tokens masking: what greedy rows take the argmax of."""
        self._check(logits, rows)
        out = logits.to(torch.float32, copy=True)
        vocab = out.shape[-1]
        penalised = [i for i, r in enumerate(rows) if _needs_penalties(r.params)]
        if penalised:
            self._apply_penalties(out, [rows[i] for i in penalised], penalised, vocab)
        for i, row in enumerate(rows):
            banned = [t for t in _min_tokens_mask(row) if t < vocab]
            if banned:
                out[i, banned] = -math.inf
        return out

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row's token is drawn from (one-hot at the argmax for greedy rows)."""
        processed = self.process_logits(logits, rows)
        out = torch.zeros_like(processed)
        out.scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            filtered = self._filtered_probs(processed[idx], [rows[i].params for i in sampled])
            out[idx] = filtered / filtered.sum(dim=-1, keepdim=True)
        return out

    # -- internals --

    @staticmethod
    def _check(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [rows, vocab] with one row per SamplingRow, got {tuple(logits.shape)} "
                f"for {len(rows)} rows"
            )

    @staticmethod
    def _apply_penalties(out: torch.Tensor, rows: list[SamplingRow], index: list[int], vocab: int) -> None:
        """Repetition penalty (transformers-style) over prompt + output, then OpenAI presence/frequency.

        Works on the flattened positions of each row's history, so the cost follows
        the history length rather than rows x vocab.
        """
        device = out.device
        flat_out = out.view(-1)

        def per_position(name: str, positions: torch.Tensor) -> torch.Tensor:
            """The owning row's value of parameter `name` at each flattened position."""
            values = torch.zeros(out.shape[0], dtype=out.dtype)
            values[index] = torch.tensor([getattr(r.params, name) for r in rows], dtype=out.dtype)
            return values.to(device)[positions // vocab]

        if any(r.params.repetition_penalty != 1.0 for r in rows):
            seen = _flat_ids([chain(r.prompt_ids, r.output_ids) for r in rows], index, vocab, device).unique()
            rep = per_position("repetition_penalty", seen)
            scores = flat_out[seen]
            flat_out[seen] = torch.where(scores > 0, scores / rep, scores * rep)

        if any(r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0 for r in rows):
            generated, counts = _flat_ids([r.output_ids for r in rows], index, vocab, device).unique(
                return_counts=True
            )
            penalty = per_position("frequency_penalty", generated) * counts.to(out.dtype)
            penalty += per_position("presence_penalty", generated)
            flat_out[generated] -= penalty

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, then min-p, batched with per-row tensors.

        Returns unnormalised probabilities with zeros outside each row's kept set;
        the draw does not need them to sum to one.
        """
        device, vocab = logits.device, logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        scaled = logits / temps[:, None]

        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        use_top_p = any(p.top_p < 1.0 for p in params)
        if any(ks) or use_top_p:
            # Only the head some row can keep needs sorting: the largest top_k, or the
            # whole vocabulary when a row uses top_p without top_k.
            full = any(p.top_p < 1.0 and k == 0 for p, k in zip(params, ks, strict=True))
            width = vocab if full else max(ks)
            if full:
                sorted_logits, order = scaled.sort(dim=-1, descending=True)
            else:
                sorted_logits, order = scaled.topk(width, dim=-1)
            has_top_k = torch.tensor([k > 0 for k in ks], device=device)
            if any(ks):
                limits = torch.tensor([k or vocab for k in ks], device=device)
                ranks = torch.arange(width, device=device)
                sorted_logits.masked_fill_(ranks[None, :] >= limits[:, None], -math.inf)
            if use_top_p:
                # Keep the smallest prefix whose mass reaches top_p: drop a token when the
                # mass ranked strictly above it already does. top_p=1 rows are exempt, since
                # rounding can push the running sum to 1 before the tail.
                ps = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=device)
                sorted_probs = sorted_logits.softmax(dim=-1)
                mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
                drop = mass_above >= ps[:, None].to(mass_above.dtype)
                sorted_logits.masked_fill_(drop, -math.inf)
            # Rows with top_k drop everything outside the head; the others keep their tail.
            scaled = scaled.masked_fill(has_top_k[:, None], -math.inf).scatter_(1, order, sorted_logits)

        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.

        It needs one noise vector per row, so each seeded row fills its own from its own
        generator while unseeded rows share one fill from the default generator.
        Overwrites `probs`, which is the sampler's own scratch tensor.
        """
        device = probs.device
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._default_for(device))
        elif unseeded:
            idx = torch.tensor(unseeded, device=device)
            block = torch.empty(len(unseeded), probs.shape[-1], dtype=probs.dtype, device=device)
            noise[idx] = block.exponential_(generator=self._default_for(device))
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                gen = self._scratch_for(device)
                gen.manual_seed(_step_seed(row.params.seed, len(row.output_ids)))
                # A fresh 1-D tensor so the stream does not depend on the row's position.
                noise[i] = torch.empty(probs.shape[-1], dtype=probs.dtype, device=device).exponential_(
                    generator=gen
                )
        # Exp(1) can round to 0; a tiny floor keeps 0 / 0 (masked tokens) out of the argmax.
        return probs.div_(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _default_for(self, device: torch.device) -> torch.Generator | None:
        gen = self.default_generator
        if gen is not None and gen.device.type != device.type:
            raise ValueError(
                f"default_generator is on {gen.device} but the logits are on {device}; "
                "create the generator on the logits' device"
            )
        return gen

    def _scratch_for(self, device: torch.device) -> torch.Generator:
        gen = self._scratch.get(device)
        if gen is None:
            gen = self._scratch[device] = torch.Generator(device=device)
        return gen

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        """Logprobs from the raw logits' log_softmax (vLLM's default), before any penalty or filter."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        idx = torch.tensor(wanted, device=logits.device)
        lsm = logits[idx].float().log_softmax(dim=-1)
        chosen = torch.tensor([token_ids[i] for i in wanted], device=logits.device)
        chosen_lp = lsm.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(rows[i].params.logprobs for i in wanted)
        top_lp, top_ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        result: list[TokenLogprobs | None] = [None] * len(rows)
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            top = tuple(zip(top_ids[j][:n], top_lp[j][:n], strict=True))
            result[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen_lp[j], top=top)
        return result
