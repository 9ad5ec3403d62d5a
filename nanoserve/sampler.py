"""The batched `Sampler` that turns a [rows, vocab] logits batch into one next token per row.

It applies, in the order vLLM and transformers use: a structured output's grammar mask, repetition
penalty, presence/frequency penalties, min_tokens masking, logit_bias, allowed_token_ids and bad_words,
then argmax for greedy rows, or temperature, top-k, top-p, min-p and a random draw for the others.
Where the later bans would leave a constrained row no token at all (min_tokens holding back the end of
sequence its complete grammar demands), the grammar's mask alone decides: the output stays valid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.mask import GrammarMasker

__all__ = ["SampleResult", "Sampler", "SamplingRow", "TokenLogprobs", "token_logprobs"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_seed(seed: int, step: int) -> int:
    """Seed for a row's draw at `step`; mixed so that (s, k) and (s + 1, k - 1) are unrelated."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


@dataclass
class SamplingRow:
    """One row of a batch: its parameters and the history penalties and seeding need.

    `output_ids` are the tokens generated so far; their count is the step used to seed
    the row's draw. `eos_token_ids` are masked (with `params.stop_token_ids`) while fewer
    than `params.min_tokens` tokens have been generated, unless `params.ignore_eos`.
    A bad word's last token is masked whenever the output ends with the rest of it.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bad_word_ids: Sequence[Sequence[int]] = ()  # params.bad_words as token sequences (the engine encodes them)
    matcher: object | None = None  # the sequence's structured-output grammar (nanoserve.structured.Matcher)


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's logprob and rank (1 = most likely) in the raw distribution, and the top-N alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first; the i-th has rank i + 1
    rank: int = 1
    top_ranks: tuple[int, ...] | None = None  # each alternative's rank, when `top` is not the top (logprob_token_ids)

    def ranked_top(self) -> list[tuple[int, float, int]]:
        """(token id, logprob, rank) of each alternative."""
        ranks = self.top_ranks or range(1, len(self.top) + 1)
        return [(t, lp, r) for (t, lp), r in zip(self.top, ranks)]


@dataclass
class SampleResult:
    """Per row: the next token, and its logprobs when the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _needs_processing(row: SamplingRow) -> bool:
    """Whether the row's logits change before its pick (penalties, bans, biases, an allow-list)."""
    p = row.params
    return bool(_needs_penalties(p) or _min_tokens_mask(row) or p.logit_bias or p.allowed_token_ids
                or row.bad_word_ids or row.matcher is not None)


def _bans_tokens(row: SamplingRow) -> bool:
    """Whether anything after the grammar mask can set a row's logits to -inf."""
    return bool(row.params.allowed_token_ids or row.bad_word_ids or _min_tokens_mask(row)
                or any(b == -math.inf for b in (row.params.logit_bias or {}).values()))


def _banned_words(row: SamplingRow) -> set[int]:
    """Last tokens of the bad words whose other tokens end the output so far (a one-token word always)."""
    out = row.output_ids
    banned = set()
    for word in row.bad_word_ids:
        head = len(word) - 1
        if head == 0 or (len(out) >= head and list(out[len(out) - head:]) == list(word[:head])):
            banned.add(word[-1])
    return banned


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


def _top_k_top_p(scaled: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Top-k then top-p on rows that all use top_k (`ks` > 0) or all lack it (`ks` == 0).

    With top_k only the largest k logits are ranked (one topk of the largest k) and the
    rest are dropped; without it the whole vocabulary is sorted so top_p can see the tail.
    Returns a new tensor of the kept logits, -inf elsewhere.
    """
    device = scaled.device
    if ks[0]:
        width = max(ks)
        sorted_logits, order = scaled.topk(width, dim=-1)
        limits = torch.tensor(ks, device=device)
        ranks = torch.arange(width, device=device)
        sorted_logits.masked_fill_(ranks[None, :] >= limits[:, None], -math.inf)
    else:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if any(p < 1.0 for p in top_ps):
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the
        # mass ranked strictly above it already does. top_p=1 rows are exempt, since
        # rounding can push the running sum to 1 before the tail.
        ps = torch.tensor([p if p < 1.0 else math.inf for p in top_ps], device=device)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_above >= ps[:, None].to(mass_above.dtype)
        sorted_logits.masked_fill_(drop, -math.inf)
    if ks[0]:
        return torch.full_like(scaled, -math.inf).scatter_(1, order, sorted_logits)
    # A full sort's order is a permutation of every column, so the scatter fills them all.
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


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

    def __init__(self, default_generator: torch.Generator | None = None, masker: GrammarMasker | None = None,
                 argmax=None):
        self.default_generator = default_generator
        self.argmax = argmax  # rows -> indices (the fused CPU kernels' one-pass argmax), else torch.argmax
        self.masker = masker if masker is not None else GrammarMasker()
        # One scratch generator per device, re-seeded for every seeded row.
        self._scratch: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Sample one token per row; `logits` is never modified."""
        self._check(logits, rows)
        n = len(rows)
        want_logprobs = [r.params.logprobs is not None for r in rows]
        # Fast path: plain greedy batch, one argmax on the raw logits.
        if all(r.params.greedy and not _needs_processing(r) for r in rows):
            tokens = logits.argmax(dim=-1) if self.argmax is None else self.argmax(logits)
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
        """Logits after the grammar mask, penalties, min_tokens masking, logit_bias, allowed_token_ids and
        bad_words: what greedy rows take the argmax of."""
        self._check(logits, rows)
        out = logits.to(torch.float32, copy=True)
        vocab = out.shape[-1]
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            self.masker.apply(out, constrained, [rows[i].matcher for i in constrained])
        # constrained rows that later bans could leave with no token: their grammar-only logits are kept
        guarded = [i for i in constrained if _bans_tokens(rows[i])]
        grammar_only = out[guarded] if guarded else None
        penalised = [i for i, r in enumerate(rows) if _needs_penalties(r.params)]
        if penalised:
            self._apply_penalties(out, [rows[i] for i in penalised], penalised, vocab)
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < vocab]
                out[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=out.dtype, device=out.device)
            if p.allowed_token_ids:
                keep = torch.full((vocab,), -math.inf, dtype=out.dtype, device=out.device)
                keep[[t for t in p.allowed_token_ids if t < vocab]] = 0.0
                out[i] += keep
            banned = [t for t in _min_tokens_mask(row) | _banned_words(row) if t < vocab]
            if banned:
                out[i, banned] = -math.inf
        if guarded:
            index = torch.tensor(guarded, device=out.device)
            dead = (out[index] == -math.inf).all(dim=-1)
            if bool(dead.any()):
                out[index[dead]] = grammar_only[dead]
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
        # Each row sorts only the head it can keep: rows with top_k share one topk of the
        # largest k, rows with top_p but no top_k need the whole vocabulary sorted, and
        # rows with neither are not sorted at all. A full sort for one row must not be
        # paid by every sampled row in the batch.
        head = [i for i, k in enumerate(ks) if k]
        full = [i for i, (p, k) in enumerate(zip(params, ks, strict=True)) if not k and p.top_p < 1.0]
        for group in (head, full):
            if not group:
                continue
            if len(group) == len(params):
                scaled = _top_k_top_p(scaled, [ks[i] for i in group], [params[i].top_p for i in group])
            else:
                idx = torch.tensor(group, device=device)
                scaled[idx] = _top_k_top_p(
                    scaled[idx], [ks[i] for i in group], [params[i].top_p for i in group]
                )

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
        result: list[TokenLogprobs | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        explicit = [i for i in wanted if rows[i].params.logprob_token_ids]
        natural = [i for i in wanted if not rows[i].params.logprob_token_ids]
        if natural:
            idx = torch.tensor(natural, device=logits.device)
            entries = token_logprobs(logits[idx], [token_ids[i] for i in natural],
                                     [rows[i].params.logprobs for i in natural])
            for i, entry in zip(natural, entries, strict=True):
                result[i] = entry
        for i in explicit:
            result[i] = chosen_ids_logprobs(logits[i], token_ids[i], rows[i].params.logprob_token_ids)
        return result


def chosen_ids_logprobs(logits: torch.Tensor, chosen: int, ids: Sequence[int]) -> TokenLogprobs:
    """One row's logprobs of the sampled token and, as its alternatives, of exactly `ids` (vLLM's
    logprob_token_ids, which scorers use to read a fixed label set): the sampled token first when it is not one of
    them, then `ids` in the order asked, each with its true rank."""
    lsm = logits.float().log_softmax(dim=-1)
    listed = ([chosen] if chosen not in ids else []) + list(ids)
    picked = lsm[torch.tensor(listed, device=logits.device)]
    ranks = ((lsm[None, :] > picked[:, None]).sum(dim=-1) + 1).tolist()
    lps = picked.tolist()
    own = listed.index(chosen)
    return TokenLogprobs(token_id=chosen, logprob=lps[own], top=tuple(zip(listed, lps)), rank=ranks[own],
                         top_ranks=tuple(ranks))


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of raw `logits`: the chosen token's logprob and rank, and the row's top `top_n[i]` alternatives.

    Shared by sampled tokens and prompt tokens (whose "chosen" token is the prompt's next one), so both report
    the same numbers a client would compute from the same logits.
    """
    lsm = logits.float().log_softmax(dim=-1)
    chosen_t = torch.tensor(list(chosen), device=logits.device)
    chosen_lp = lsm.gather(1, chosen_t[:, None])
    ranks = ((lsm > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_lp = chosen_lp[:, 0].tolist()
    k = min(max(top_n, default=0), lsm.shape[-1])
    top_lp, top_ids = lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(token_id=int(t), logprob=chosen_lp[j], top=tuple(zip(top_ids[j][:n], top_lp[j][:n])),
                      rank=ranks[j])
        for j, (t, n) in enumerate(zip(chosen, top_n, strict=True))
    ]
