"""What the engine hands back each step, shaped like vLLM's RequestOutput so scripts carry over."""

from __future__ import annotations

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
        for rank, (token, lp) in enumerate(e.top, start=1):
            out.setdefault(token, Logprob(lp, rank, self._text(token)))
        return out

    def entries(self, start: int = 0) -> list[TokenLogprobs | None]:
        """The engine's own entries from `start` (the server formats these into OpenAI's shapes)."""
        return list(self._entries[start:self._len])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LogprobSequence({list(self)!r})"


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: LogprobSequence | None = None  # per generated token, when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs (with logprobs set)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


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

    @property
    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
