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
    accepted: dict[int, int] = field(default_factory=dict)  # Request.serial -> drafted tokens the step kept

    def rows(self):
        """(request, token, logprobs) per sampled row."""
        return zip(self.sampled, self.token_ids, self.logprobs)

    def layers(self) -> list[StepResult]:
        """The result as steps of one token a request: a request that verified drafts has its kept tokens in
        successive layers, so each is appended, checked for a stop and turned into text as a one-token step
        would do it. The first layer carries the prompt logprobs and the accepted counts."""
        if not self.accepted:
            return [self]
        layers: list[list[tuple]] = []
        seen: dict[int, int] = {}
        for row in self.rows():
            depth = seen[row[0].serial] = seen.get(row[0].serial, -1) + 1
            if depth == len(layers):
                layers.append([])
            layers[depth].append(row)
        return [StepResult([r for r, _, _ in rows], [t for _, t, _ in rows], [lp for _, _, lp in rows],
                           self.prompt_logprobs if depth == 0 else [], self.accepted if depth == 0 else {})
                for depth, rows in enumerate(layers)]

    def without_requests(self, request_ids: set[str]) -> StepResult:
        """This layer less every row (and prompt logprob) of the requests named."""
        rows = [row for row in self.rows() if row[0].request_id not in request_ids]
        return StepResult([r for r, _, _ in rows], [t for _, t, _ in rows], [lp for _, _, lp in rows],
                          [p for p in self.prompt_logprobs if p[0].request_id not in request_ids], self.accepted)

    def without_finished(self) -> StepResult:
        """This layer less the rows of requests that ended on an earlier layer's token."""
        rows = [row for row in self.rows() if not row[0].finished]
        return StepResult([r for r, _, _ in rows], [t for _, t, _ in rows], [lp for _, _, lp in rows],
                          self.prompt_logprobs, self.accepted)
