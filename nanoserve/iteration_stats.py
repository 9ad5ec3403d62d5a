"""What each engine step and each finished request amount to, counted the way vLLM counts them, for its `vllm:`
metrics (vllm/v1/metrics/loggers.py).

Per step and per token:
- tokens per step (`vllm:iteration_tokens_total`): of each sequence that produced a token, its whole prompt when
  the token is its first (cached tokens included, as vLLM counts them), plus the tokens it produced;
- the gap before each token after a sequence's first (`vllm:inter_token_latency_seconds`);
- prompt tokens (whole prompts, at their first token) and generated tokens (`vllm:prompt_tokens`,
  `vllm:generation_tokens`).
Per finished sequence (a request with n > 1 is n, as vLLM's n child requests are): its phases (queue, prefill,
decode, inference, end to end, time to first token, time per output token), its token counts and its parameters.

The histograms are bucket counts kept here, on the engine's thread, and published in the stats snapshot, so a
data-parallel replica's reach the front end's /metrics with its snapshot, labelled with its engine index. The
buckets are vLLM's (vllm/v1/metrics/buckets.py), so its dashboards' quantiles read the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def one_two_five(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most`: vLLM's token-count buckets, capped at the context length."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class BucketCounts:
    """A Prometheus histogram's state: how many observations fell at or under each bound and above the last
    (not cumulative), their sum and their number."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


# histogram name (vLLM's, without "vllm:") -> its buckets; "tokens" are the context-length token buckets
REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
    "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_time_per_output_token_seconds": INTER_TOKEN_LATENCY_BUCKETS,
    "request_prompt_tokens": "tokens",
    "request_generation_tokens": "tokens",
    "request_prefill_kv_computed_tokens": "tokens",
    "request_params_max_tokens": "tokens",
    "request_max_num_generation_tokens": "tokens",
    "request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
}


class IterationStats:
    """Fed by the output processor: every sampled token of a step (`token`), the step's end (`step_done`) and
    every sequence that finished (`finished`)."""

    def __init__(self, max_model_len: int):
        tokens = one_two_five(max_model_len)
        self.histograms = {"iteration_tokens_total": BucketCounts(ITERATION_TOKENS_BUCKETS),
                           "inter_token_latency_seconds": BucketCounts(INTER_TOKEN_LATENCY_BUCKETS),
                           **{name: BucketCounts(tokens if bounds == "tokens" else bounds)
                              for name, bounds in REQUEST_HISTOGRAMS.items()}}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._step_tokens = 0

    def token(self, prompt_tokens: int, first: bool, since_last: float | None) -> None:
        """One sampled token of a sequence with `prompt_tokens`; `first`: its first; `since_last`: the time since
        its previous token (None for the first)."""
        if first:
            self.prompt_tokens += prompt_tokens
            self._step_tokens += prompt_tokens
        elif since_last is not None:
            self.histograms["inter_token_latency_seconds"].observe(since_last)
        self.generation_tokens += 1
        self._step_tokens += 1

    def step_done(self) -> None:
        """The step's tokens as one observation (a step that produced none, a prefill chunk, is not one)."""
        if self._step_tokens:
            self.histograms["iteration_tokens_total"].observe(self._step_tokens)
            self._step_tokens = 0

    def finished(self, req) -> None:
        """A sequence that ended (stopped, cut, aborted): the phases it reached and its counts."""
        seen = {"request_prompt_tokens": len(req.prompt_ids), "request_generation_tokens": len(req.output_ids),
                "request_params_max_tokens": req.max_tokens, "request_max_num_generation_tokens": req.max_tokens,
                "request_params_n": req.params.n, "request_num_preemptions": req.num_preemptions}
        end, scheduled, first, last = req.finished_time, req.first_scheduled_time, req.first_token_time, \
            req.last_token_time
        if end is not None:
            seen["e2e_request_latency_seconds"] = end - req.arrival_time
        if scheduled is not None:
            seen["request_queue_time_seconds"] = scheduled - req.arrival_time
            seen["request_prefill_kv_computed_tokens"] = len(req.prompt_ids) - (req.num_cached_tokens or 0)
            if last is not None:
                seen["request_inference_time_seconds"] = last - scheduled
        if first is not None:
            seen["time_to_first_token_seconds"] = first - req.arrival_time
            if scheduled is not None:
                seen["request_prefill_time_seconds"] = first - scheduled
            seen["request_decode_time_seconds"] = last - first
            if len(req.output_ids) > 1:
                seen["request_time_per_output_token_seconds"] = (last - first) / (len(req.output_ids) - 1)
        for name, value in seen.items():
            self.histograms[name].observe(value)

    def as_dict(self) -> dict:
        return {"histograms": {name: h.as_dict() for name, h in self.histograms.items()},
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens}
