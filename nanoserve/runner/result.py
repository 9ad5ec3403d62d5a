"""StepResult: what the model runner hands back for one step, for the scheduler and the output processor."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepResult:
    """The step's sampled rows in row order, each with its token and (when asked for) its logprobs, and the
    prompt logprobs its prefill chunks scored: (request, position, entry), the logprob of the prompt token at
    `position` given the ones before it."""

    sampled: list = field(default_factory=list)  # Request per sampled row
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs | None per sampled row
    prompt_logprobs: list[tuple] = field(default_factory=list)

    def rows(self):
        """(request, token, logprobs) per sampled row."""
        return zip(self.sampled, self.token_ids, self.logprobs)
