"""Request: one prompt's life in the engine, from waiting to a finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from nanoserve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    text: str = ""
    logprobs: list = field(default_factory=list)

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
