"""What the engine hands back each step, shaped like vLLM's RequestOutput so scripts carry over."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.sampling import TokenLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""  # text that became safe to emit this step
    delta_token_ids: tuple[int, ...] = ()
    metrics: RequestMetrics | None = field(default=None, compare=False)

    @property
    def usage(self) -> dict:
        completion = len(self.outputs[0].token_ids)
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
