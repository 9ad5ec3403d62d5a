"""Request: one prompt's life in the engine, from waiting to a finish reason."""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field

from nanoserve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_serials = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence. A request with n > 1 is n of these sharing `request_id`, each with its choice `index`."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # its block table: written by the KV manager alone
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it ended with finish_reason "error", when its own input was the cause
    first_scheduled_time: float | None = None  # when the scheduler first admitted it (its queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None  # its latest token's (the gap to the next is an inter-token latency)
    finished_time: float | None = None
    num_preemptions: int = 0
    text_pieces: list[str] = field(default_factory=list)  # the text emitted so far, as the pieces it came in
    logprobs: list = field(default_factory=list)  # TokenLogprobs per generated token, when asked for
    prompt_logprobs: list | None = None  # position -> TokenLogprobs (None at 0), when asked for
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs (when logprobs are computed)
    index: int = 0  # which of the request's n completions this sequence is
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
    eos_token_ids: frozenset[int] = frozenset()  # the tokenizer's, as they were when the request arrived
    user: str | None = None  # who sent it, when the client said (OpenAI's `user`)
    session_id: str | None = None  # the conversation or agent session it belongs to, when said (vLLM's)
    cache_salt: str | None = None  # shares cached blocks only with requests of the same salt (vLLM's)
    matcher: object | None = None  # its structured output's grammar state (nanoserve.structured.Matcher)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached (usage)
    # its prompt's blocks it put into the prefix cache, index -> tokens (Anthropic's cache_creation_input_tokens)
    cache_written: dict[int, int] = field(default_factory=dict)
    streamed: bool = True  # someone sees its tokens as they come (a stream): the step-time budget protects it
    spec_draft_tokens: int = 0  # tokens drafted for it (speculative decoding), and of those, kept
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0  # drafts verified for it
    spec_judged_from: tuple[int, int] = (0, 0)  # (drafted, kept) when its acceptance was last judged
    spec_paused_until: int = 0  # the drafter's step from which it may draft again
    spec_length: int | None = None  # how many tokens its next draft may have (None: the configured most)
    # Never repeats in a process: a client may reuse a finished request's id, so anything keyed across steps
    # (a decode row, a table row) is keyed on this, not on request_id.
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def num_cache_written_tokens(self) -> int | None:
        """Prompt tokens this request wrote into the prefix cache, None while caching is off; never more than
        the prompt tokens it did not find there (a block written again after an eviction counts once)."""
        if self.num_cached_tokens is None:
            return None
        return min(sum(self.cache_written.values()), len(self.prompt_ids) - self.num_cached_tokens)

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def key(self) -> tuple[int, int]:
        """This sequence's identity for planned addressing: a preempted one returns with new blocks, a new key."""
        return (self.serial, self.num_preemptions)

    @property
    def name(self) -> str:
        """A label unique among live sequences (siblings of an n > 1 request share request_id)."""
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @functools.cached_property
    def prompt_tuple(self) -> tuple[int, ...]:
        """The prompt ids as the tuple every output carries: built once, not once a step."""
        return tuple(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
