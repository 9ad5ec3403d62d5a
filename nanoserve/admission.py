"""Admission: a request checked against every limit and turned into its sequences, before anything is allocated.

Text prompts are tokenized here, token-id prompts checked against the vocabulary, sampling parameters against the
model, and prompt + max_tokens against max_model_len; bad words become token sequences and a structured output's
grammar is compiled (cached). A request with n > 1 becomes n sequences sharing the prompt.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from nanoserve.errors import RequestError
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams


class Admission:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int, grammars,
                 in_use: Callable[[str], bool]):
        """`in_use(request_id)`: whether a live request already has that id."""
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_logprobs, self.grammars, self._in_use = max_logprobs, grammars, in_use
        self._ids = itertools.count()

    def sequences(self, prompt, params: SamplingParams | None, request_id: str | None, *,
                  arrival_time: float | None = None, user: str | None = None, cache_salt: str | None = None,
                  session_id: str | None = None) -> list[Request]:
        """The request's sequences (n of them), or RequestError saying what is wrong and how to fix it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}; send one per tenant")
        if self._in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in use; pick a unique id")
        text, ids = self.prompt_ids(prompt)
        params = params.validate_against(self.vocab_size, self.max_logprobs)
        max_tokens = self._max_tokens(len(ids), params.max_tokens)
        bad_words = self.bad_word_ids(params.bad_words)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        group = []
        arrived = time.monotonic() if arrival_time is None else arrival_time  # one arrival for all n sequences
        for index in range(params.n):
            own = params if params.n == 1 else params.for_completion(index)
            if index:  # the prompt's logprobs are the same for every completion: compute them once
                own = dataclasses.replace(own, prompt_logprobs=None)
            req = Request(request_id, text, ids, own, max_tokens, index=index, bad_word_ids=bad_words, user=user,
                          eos_token_ids=self.tokenizer.eos_token_ids,
                          session_id=session_id, cache_salt=cache_salt, matcher=grammar.matcher() if grammar else None)
            if own.prompt_logprobs is not None:
                req.prompt_logprobs = [None] * len(ids)
            req.arrival_time = arrived
            group.append(req)
        return group

    def _max_tokens(self, prompt_len: int, asked: int | None) -> int:
        """max_tokens as asked, or all that max_model_len leaves after the prompt."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise RequestError(
                f"prompt is {prompt_len} tokens but max_model_len is {self.max_model_len}; shorten it or "
                "start with a larger --max-model-len"
            )
        if asked is not None and asked > room:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({asked}) = {prompt_len + asked} exceeds "
                f"max_model_len {self.max_model_len}; lower max_tokens to at most {room} or shorten the prompt"
            )
        return asked if asked is not None else room

    def bad_word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the token sequences it can be written with: alone, and after a space (vLLM's rule)."""
        seqs = set()
        for word in words or ():
            for form in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(form, add_special_tokens=False))
                if ids:
                    seqs.add(ids)
        return tuple(sorted(seqs))

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is out of vocabulary (this model's ids are [0, {self.vocab_size})); "
                    "encode the prompt with this model's tokenizer"
                )
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty; send at least one token")
        return text, ids
