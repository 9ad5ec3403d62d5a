"""One snapshot from the replicas' own, for /health, /metrics' nanoserve: names and the console.

Counts add up (requests running and waiting, tokens, KV blocks, prefix-cache lookups and hits, reads); the rows
are every replica's, each marked with its replica; what describes the model (flags, dtype, numerics) is the first
replica's, since every replica loads the same flags. The optional features' sections (stalls, step budget,
windows, kernels) are the first replica's too: they mix counts with thresholds, targets and percentiles, which do
not add. Request latency percentiles are the front end's own, over the final outputs it relayed (percentiles of
replicas' percentiles would be no percentile at all); the step percentiles are the slowest replica's. Per-replica
figures stay available in features["data_parallel"].
"""

from __future__ import annotations

import dataclasses
from collections import deque

from nanoserve.stats import EngineStats, KVStats, LatencyStats, PrefixCacheStats, SchedulerStats, percentiles

LATENCY_WINDOW = 256  # the finished requests the front end's percentiles cover (the engine's own window)
ROWS_KEPT = 100  # finished rows in the merged snapshot, as one engine's


class FrontLatency:
    """TTFT and TPOT of the requests the front end relayed, from their final outputs' timestamps."""

    def __init__(self):
        self._ttfts: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._tpots: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def finished(self, output) -> None:
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None:
            return
        self._ttfts.append(metrics.first_token_time - metrics.arrival_time)
        n = len(output.outputs[0].token_ids) if output.outputs else 0
        if n > 1 and metrics.finished_time is not None:
            self._tpots.append((metrics.finished_time - metrics.first_token_time) / (n - 1))

    def stats(self, replicas: list[EngineStats]) -> LatencyStats:
        steps_p50 = [s.latency.step_p50 for s in replicas if s.latency.step_p50 is not None]
        steps_p99 = [s.latency.step_p99 for s in replicas if s.latency.step_p99 is not None]
        return LatencyStats(len(self._ttfts), *percentiles(list(self._ttfts), 0.5, 0.99),
                            *percentiles(list(self._tpots), 0.5, 0.99), max(steps_p50, default=None),
                            max(steps_p99, default=None))


def _sum_fields(items, cls, **fixed):
    """A dataclass of `cls` whose numeric fields are the sums over `items` (fields in `fixed` given)."""
    values = dict(fixed)
    for f in dataclasses.fields(cls):
        if f.name in values:
            continue
        got = [getattr(item, f.name) for item in items]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got):
            values[f.name] = sum(got)
        else:
            values[f.name] = got[0]
    return cls(**values)


def _finished_counts(stats: list[EngineStats]) -> dict:
    total: dict = {}
    for s in stats:
        for reason, n in s.scheduler.finished.items():
            total[reason] = total.get(reason, 0) + n
    return total


def merge(replicas: list[tuple[int, EngineStats]], latency: FrontLatency, data_parallel: dict) -> EngineStats:
    """The server's snapshot from each replica's latest (rank, stats); `data_parallel` is published as a
    feature (the replicas' table, /health's `data_parallel`)."""
    stats = [s for _, s in replicas]
    first = stats[0]
    scheduler = _sum_fields([s.scheduler for s in stats], SchedulerStats, finished=_finished_counts(stats))
    kv = _sum_fields([s.kv for s in stats], KVStats, block_size=first.kv.block_size)
    prefix = _sum_fields([s.prefix_cache for s in stats], PrefixCacheStats,
                         enabled=any(s.prefix_cache.enabled for s in stats))
    read = _sum_fields([s.paged_read for s in stats], type(first.paged_read), mode=first.paged_read.mode,
                       block=first.paged_read.block)
    rows = tuple(dataclasses.replace(r, replica=rank) for rank, s in replicas for r in s.rows)
    finished = tuple(dataclasses.replace(r, replica=rank) for rank, s in replicas for r in s.finished_rows)
    devices = sorted({s.device for s in stats})
    return dataclasses.replace(
        first, device=", ".join(devices), scheduler=scheduler, kv=kv, prefix_cache=prefix, paged_read=read,
        rows=rows, finished_rows=finished[:ROWS_KEPT], latency=latency.stats(stats),
        features={**first.features, "data_parallel": data_parallel},
        vllm_counts={})  # per engine only: /metrics reads each replica's own (engine_stats), never a sum
