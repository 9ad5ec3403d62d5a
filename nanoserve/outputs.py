"""What the engine hands back each step, shaped like vLLM's RequestOutput so scripts carry over."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanoserve.sampling import TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: one token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class LogprobSequence(Sequence):
    """vLLM's `list[dict[token id, Logprob]]` (None where a position has none, as a prompt's first token).

    A view over the engine's own entries, converted on access: building an output each step costs nothing
    however long the sequence is. The view's length is fixed when it is made, so later steps never change it.
    """

    def __init__(self, entries: Sequence[TokenLogprobs | None], token_text: Callable[[int], str],
                 length: int | None = None):
        self._entries, self._text = entries, token_text
        self._len = len(entries) if length is None else length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not -self._len <= i < self._len:
            raise IndexError(i)
        entry = self._entries[i % self._len]
        return None if entry is None else self._convert(entry)

    def _convert(self, e: TokenLogprobs) -> dict[int, Logprob]:
        out = {e.token_id: Logprob(e.logprob, e.rank, self._text(e.token_id))}
        for token, lp, rank in e.ranked_top():
            out.setdefault(token, Logprob(lp, rank, self._text(token)))
        return out

    def entries(self, start: int = 0) -> list[TokenLogprobs | None]:
        """The engine's own entries from `start` (the server formats these into OpenAI's shapes)."""
        return list(self._entries[start:self._len])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LogprobSequence({list(self)!r})"


class TokenIds(Sequence):
    """A sequence's token ids up to the length they had when an output was made.

    A view over the request's own append-only list: an output costs the same to build at token 5 and at token
    5,000, where copying the ids into every step's output cost O(n) a step and O(n^2) over a request's life.
    It reads and compares as the tuple it stands for (slices are tuples).
    """

    __slots__ = ("_ids", "_len")

    def __init__(self, ids: Sequence[int], length: int | None = None):
        self._ids, self._len = ids, len(ids) if length is None else length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._ids[j] for j in range(*i.indices(self._len)))
        if not -self._len <= i < self._len:
            raise IndexError(i)
        return self._ids[i % self._len]

    def __iter__(self):
        return itertools.islice(self._ids, self._len)  # bounded: the list may grow while it is read

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        return (*self, *other)

    def __radd__(self, other):
        return (*other, *self)

    def __repr__(self) -> str:
        return repr(tuple(self))


class TextSoFar:
    """A sequence's text as the pieces the detokenizer emitted, up to the count it had when an output was made;
    joined only when read, for the same reason as TokenIds (a streaming consumer reads the deltas instead)."""

    __slots__ = ("_pieces", "_count")

    def __init__(self, pieces: list[str], count: int | None = None):
        self._pieces, self._count = pieces, len(pieces) if count is None else count

    def __str__(self) -> str:
        return "".join(self._pieces[: self._count])


class CompletionOutput:
    """One completion's state: vLLM's CompletionOutput (cumulative text and token ids, as vLLM's default
    output kind gives them). `text` may be given as a TextSoFar and `token_ids` as a TokenIds, so building
    one each step costs nothing however long the completion is; `text` is joined on first read."""

    __slots__ = ("index", "_text", "token_ids", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob")

    def __init__(self, index: int, text: str | TextSoFar, token_ids: Sequence[int],
                 finish_reason: str | None,  # "stop" | "length" | "abort" | None while running
                 stop_reason: str | int | None = None,  # the stop string or stop token id that ended it
                 logprobs: LogprobSequence | None = None,  # per generated token, when SamplingParams.logprobs
                 cumulative_logprob: float | None = None):  # sum of the generated tokens' logprobs
        self.index, self._text, self.token_ids = index, text, token_ids
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.logprobs, self.cumulative_logprob = logprobs, cumulative_logprob

    @property
    def text(self) -> str:
        if not isinstance(self._text, str):
            self._text = str(self._text)
        return self._text

    def finished(self) -> bool:
        return self.finish_reason is not None

    def _key(self) -> tuple:
        return (self.index, self.text, tuple(self.token_ids), self.finish_reason, self.stop_reason,
                self.logprobs, self.cumulative_logprob)

    def __eq__(self, other) -> bool:
        return isinstance(other, CompletionOutput) and self._key() == other._key()

    __hash__ = None  # mutable-looking, like the dataclass it replaces (eq without frozen)

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r}, "
                f"cumulative_logprob={self.cumulative_logprob!r})")


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    spec_draft_tokens: int = 0  # tokens drafted for it by speculative decoding, and of those, kept
    spec_accepted_tokens: int = 0
    first_scheduled_time: float | None = None  # its queue time ends here (None: never scheduled, aborted waiting)
    max_tokens: int | None = None  # what it could generate (params.max_tokens, or what the context left)
    n: int = 1  # its request's n
    last_token_time: float | None = None  # its latest token's


@dataclass(frozen=True)
class RequestOutput:
    """One request's state after a step. With n > 1 each output carries the one completion that moved
    (`outputs[0].index` says which); `finished` is True once, on the last output of the whole request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""  # text of outputs[0] that became safe to emit this step
    delta_token_ids: tuple[int, ...] = ()
    metrics: RequestMetrics | None = field(default=None, compare=False)
    prompt_logprobs: LogprobSequence | None = None  # None first, then one dict per prompt token
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None: caching off)
    error: str | None = None  # finish_reason "error": what in the request failed it (its grammar), for its caller
    num_cache_written_tokens: int | None = None  # prompt tokens it put into the prefix cache (None: caching off)

    @property
    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
