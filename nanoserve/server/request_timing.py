"""vLLM's per-request timing (`--enable-per-request-metrics`): a `metrics` object on a whole completion or chat
completion, or on a stream's final usage chunk, measured from the request's own timestamps in the engine (the
clock its scheduler and output processor read), for one sequence: with n > 1 or several prompts there is no one
request to time, and vLLM leaves it out too.

- time_to_first_token_ms: first scheduled -> first token (vLLM's: the queue is counted apart)
- generation_time_ms: first token -> last token
- queue_time_ms: arrival -> first scheduled
- mean_itl_ms: generation time over the gaps between tokens (absent for a single token)
- tokens_per_second: tokens over first scheduled -> last token
A figure whose timestamps are missing (a request aborted while it waited) is left out.
"""

from __future__ import annotations

from nanoserve.outputs import RequestMetrics


def timing_metrics(m: RequestMetrics | None, generated: int) -> dict:
    if m is None:
        return {}
    scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
    out = {}
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
    if scheduled is not None:
        out["queue_time_ms"] = (scheduled - m.arrival_time) * 1000
    if first is not None and last is not None and generated > 1:
        out["mean_itl_ms"] = (last - first) / (generated - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = generated / (last - scheduled)
    return out
