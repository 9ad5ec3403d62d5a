"""Generated ids -> text that is safe to emit: whole characters only, stop strings never shown.

`IncrementalDetokenizer` and `StopStringMatcher` are the two halves; `TextStream` joins them for one request and
finds the way a reply ends in its text: a stop string (which may span tokens). The ways it ends on a token (EOS,
a stop token id) and length limits are the scheduler's (scheduler.stop_token).
"""

from __future__ import annotations

from collections.abc import Iterable

from nanoserve.errors import RequestError
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    """One sequence's text. Every way it ends, whatever the reason, is followed by `flush()`: what it returns is
    exactly the text still owed (nothing past a matched stop string), so calling it is always right."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens) \
            if params.detokenize else None
        self.stops = StopStringMatcher(params.stop) if params.stop else None

    def push(self, token: int, armed: bool) -> tuple[str, str | None]:
        """Add a token that did not end the sequence by itself; returns (text to emit, the stop string it
        completed or None). `armed`: min_tokens tokens exist, so a stop string may end the text (vLLM's rule); it
        may have begun in earlier text that was held back as a possible prefix."""
        if self.detok is None:
            return "", None
        delta = self.detok.feed(token)
        if self.stops is None:
            return delta, None
        emit, matched = self.stops.feed(delta, armed=armed)
        if matched is not None and self.params.include_stop_str_in_output:
            emit += matched
        return emit, matched

    def flush(self) -> str:
        """Whatever was held back (an incomplete character, a possible stop-string prefix) at the very end."""
        if self.detok is None:
            return ""
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        emit, _ = self.stops.feed(tail)  # a finished text had min_tokens, or it would not have finished
        return emit + self.stops.flush()

class IncrementalDetokenizer:
    """Turn generated ids into text deltas that are always whole characters.

    Each step decodes only a short window: the tokens already emitted in the previous step (the prefix, which
    gives SentencePiece-style decoders the context they need to keep a word's leading space) plus the unread
    tokens, and emits the difference. Text ending in U+FFFD may be a character whose bytes continue in the next
    token, so it is held back; the concatenation of all deltas and `flush()` equals `tokenizer.decode(ids)`.
    """

    # A UTF-8 character spans at most 4 bytes, and every non-skipped token contributes at least one byte, so once
    # this many tokens follow a boundary, the text before it can no longer change.
    _SETTLED_AFTER = 3
    # How many boundaries to try when looking for settled text inside a held-back run.
    _LOOKBACK = 4

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.skip_special_tokens = skip_special_tokens
        self._decode_fn = tokenizer.hf.decode
        # Skipped tokens never reach the decoder, so dropping them early keeps them out of the window.
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._window: list[int] = []  # ids from the prefix offset on
        self._read = 0  # index in _window where the unread ids start
        self._prefix_text = ""  # decode(_window[:_read])
        self._run_start: int | None = None  # where a trailing run of byte-fallback tokens starts in _window

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Add one or more ids; return the text that is now final (possibly "")."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        new = [t for t in ids if t not in self._skip]
        if not new:
            return ""
        for t in new:
            if t not in self._byte_ids:
                self._run_start = None
            elif self._run_start is None:
                self._run_start = len(self._window)
            self._window.append(t)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes to U+FFFD, as in `decode`)."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        # A byte-fallback decoder renders a run of byte tokens as text only if the whole run is valid UTF-8 (and as
        # one U+FFFD per byte otherwise), so a later byte can change all of it: hold the run until it ends.
        end = len(self._window)
        if not final and self._run_start is not None:
            end = max(self._run_start, self._read)
        if end == self._read:
            return ""
        text = self._decode(self._window[:end])
        if final or not text.endswith(REPLACEMENT_CHAR):
            return self._emit(text, end)
        # The trailing U+FFFD may be an unfinished character, or a real one (invalid bytes, or the model writing
        # U+FFFD). Emit up to the latest boundary whose text is settled, so a long run cannot grow the window.
        last = end - self._SETTLED_AFTER
        for k in range(last, max(self._read, last - self._LOOKBACK), -1):
            head = self._decode(self._window[:k])
            if len(head) > len(self._prefix_text) and text == head + self._decode(self._window[k:end]):
                return self._emit(head, k)
        return ""

    def _emit(self, text: str, upto: int) -> str:
        """Emit `text` (the decode of _window[:upto]) past the prefix, then slide the window to start at _read."""
        delta = text[len(self._prefix_text):]
        shift = self._read
        self._window = self._window[shift:]
        self._read = upto - shift
        if self._run_start is not None:
            self._run_start = max(self._run_start - shift, 0)
        self._prefix_text = self._decode(self._window[: self._read])
        return delta


class StopStringMatcher:
    """Cut streamed text at the first stop string, even when it spans several deltas.

    Text that could still grow into a stop string is held back until it is ruled out. When stops overlap, the one
    that is completed first wins (ties go to the longer one), so the result does not depend on how the text was
    split into deltas. The stop string and everything after it are never emitted.
    """

    def __init__(self, stop: str | Iterable[str] = ()):
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise RequestError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self._held = ""

    def feed(self, delta: str, armed: bool = True) -> tuple[str, str | None]:
        """Return (text safe to emit now, the matched stop string or None). After a match, input is ignored.

        Unarmed (min_tokens not reached yet), a whole stop string is passed through as text, but a possible
        prefix at the end is still held, so a stop string that completes once armed is still caught.
        """
        if self.matched is not None:
            return "", self.matched
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops if armed else ():
            i = text.find(stop)
            if i >= 0:
                candidate = (i + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        if best is not None:
            end, _, stop = best
            self.matched, self._held = stop, ""
            return text[: end - len(stop)], stop
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Return the held-back text at the end of the stream (nothing if a stop string matched)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
