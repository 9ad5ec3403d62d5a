"""TextStream: turns one request's sampled tokens into text it is safe to emit, and says when to stop.

It owns the three ways a reply ends on its content: an EOS token (unless ignore_eos), a stop token id,
and a stop string (which may span tokens and is never emitted). Length limits are the engine's.
"""

from __future__ import annotations

from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop) if params.stop else None
        self.eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids)

    def push(self, token: int, generated: int) -> tuple[str, str | None, str | int | None]:
        """Add the `generated`-th token; returns (text to emit, finish reason or None, stop reason)."""
        if generated >= self.params.min_tokens:
            if token in self.stop_ids:
                return "", "stop", token
            if token in self.eos:
                return "", "stop", None
        delta = self.detok.feed(token)
        if self.stops is None:
            return delta, None, None
        emit, matched = self.stops.feed(delta)
        if matched is not None:
            if self.params.include_stop_str_in_output:
                emit += matched
            return emit, "stop", matched
        return emit, None, None

    def flush(self) -> str:
        """Whatever was held back (an incomplete character, a possible stop-string prefix) at the very end."""
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        emit, _ = self.stops.feed(tail)
        return emit + self.stops.flush()
