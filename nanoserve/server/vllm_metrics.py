"""The `vllm:` metric family under vLLM's own names, types, buckets and labels (`model_name`, and `engine`:
vLLM's engine index, one series per data-parallel replica, "0" for a single engine), beside the `nanoserve:` ones.

Grafana boards, the production stack's router and the Gateway API's endpoint pickers read these names. Every
figure is read from each engine's stats snapshot at scrape time: the gauges from its scheduler and KV pool, the
counters and histograms from what its output processor counted (nanoserve/iteration_stats.py), so a replica's
series are its own.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from nanoserve.server.refusals import ADMISSION_LIMIT
from nanoserve.stats import EngineStats

V = "vllm:"
LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, every one a series

HISTOGRAM_DOCS = {
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding cached "
                                          "tokens).",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
}


def vllm_families(model: str, engines: list[tuple[str, EngineStats]], admission: dict[str, int] | None = None):
    """Every vllm: metric family over the engines' snapshots ((engine index, stats) each), and the server's
    admission rejections by the limit that made them (`admission`, counted in front of the engines)."""
    def gauge(name, doc, value):
        g = GaugeMetricFamily(V + name, doc, labels=LABELS)
        for engine, s in engines:
            g.add_metric([model, engine], value(s))
        return g

    def counter(name, doc, value):
        c = CounterMetricFamily(V + name, doc, labels=LABELS)
        for engine, s in engines:
            c.add_metric([model, engine], value(s))
        return c

    yield gauge("num_requests_running", "Number of requests in model execution batches.",
                lambda s: s.scheduler.running)
    yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.scheduler.waiting)
    yield _waiting_by_reason(model, engines)
    yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv.usage)
    yield gauge("num_kv_cache_total_blocks", "Number of KV-cache blocks in the pool.", lambda s: s.kv.blocks_total)
    yield gauge("num_prefix_cached_blocks", "KV-cache blocks holding named (prefix-cached) content, held or free.",
                lambda s: s.prefix_cache.cached_blocks)
    yield gauge("num_prefix_cached_tokens", "Tokens the prefix-cached blocks hold.",
                lambda s: s.prefix_cache.cached_blocks * s.kv.block_size)
    yield gauge("prefix_cache_usage_perc", "Fraction of the KV-cache pool holding prefix-cached content.",
                lambda s: s.prefix_cache.cached_blocks / s.kv.blocks_total if s.kv.blocks_total else 0.0)
    yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                  lambda s: s.prefix_cache.queries)
    yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                  lambda s: s.prefix_cache.hits)
    yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                  lambda s: s.scheduler.preemptions)
    yield counter("prompt_tokens", "Number of prefill tokens processed.",
                  lambda s: s.vllm_counts.get("prompt_tokens", 0))
    yield counter("generation_tokens", "Number of generation tokens processed.",
                  lambda s: s.vllm_counts.get("generation_tokens", 0))
    yield _request_success(model, engines)
    yield _admission_rejections(model, admission or {})
    yield from _histograms(model, engines)
    info = _cache_config_info(model, engines)
    if info is not None:
        yield info


def _waiting_by_reason(model, engines) -> GaugeMetricFamily:
    """Every waiting request waits for capacity (rows, tokens, blocks): nothing here defers one (vLLM's other
    reason is LoRA budgets and KV transfers)."""
    g = GaugeMetricFamily(V + "num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason "
                          "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
                          "constraints. Sum of all reasons equals vllm:num_requests_waiting.",
                          labels=[*LABELS, "reason"])
    for engine, s in engines:
        g.add_metric([model, engine, "capacity"], s.scheduler.waiting)
        g.add_metric([model, engine, "deferred"], 0)
    return g


def _admission_rejections(model, admission: dict[str, int]) -> CounterMetricFamily:
    """Requests a queue limit turned away (503) before any engine saw them: one series per limit that exists
    here (--max-waiting), counted as they happen."""
    c = CounterMetricFamily(V + "admission_rejections", "Number of admission attempts rejected by a queue limit, "
                            "by reason.", labels=["model_name", "reason"])
    for reason, n in {ADMISSION_LIMIT: 0, **admission}.items():
        c.add_metric([model, reason], n)
    return c


def _request_success(model, engines) -> CounterMetricFamily:
    c = CounterMetricFamily(V + "request_success", "Count of successfully processed requests.",
                            labels=[*LABELS, "finished_reason"])
    for engine, s in engines:
        finished = s.scheduler.finished
        for reason in dict.fromkeys([*FINISH_REASONS, *sorted(finished)]):
            c.add_metric([model, engine, reason], finished.get(reason, 0))
    return c


def _histograms(model, engines):
    for name, doc in HISTOGRAM_DOCS.items():
        family = HistogramMetricFamily(V + name, doc, labels=LABELS)
        for engine, s in engines:
            kept = s.vllm_counts.get("histograms", {}).get(name)
            if kept is None:
                continue
            running, buckets = 0, []
            for bound, n in zip([*kept["bounds"], float("inf")], kept["counts"], strict=True):
                running += n
                buckets.append((_bound(bound), running))
            family.add_metric([model, engine], buckets, kept["sum"])
        yield family


def _bound(value: float) -> str:
    """A bucket's `le` as Prometheus' client writes it (1.0, 0.5, +Inf)."""
    return "+Inf" if value == float("inf") else repr(float(value))


def _cache_config_info(model, engines) -> GaugeMetricFamily | None:
    """vLLM's cache_config_info: the pool's size in blocks and tokens, and how many requests of max_model_len it
    holds at once, which endpoint pickers read."""
    info = None
    for engine, s in engines:
        tokens = s.kv.blocks_total * s.kv.block_size
        config = {"block_size": s.kv.block_size, "num_gpu_blocks": s.kv.blocks_total, "num_cpu_blocks": 0,
                  "cache_dtype": s.dtype, "enable_prefix_caching": s.prefix_cache.enabled,
                  "gpu_memory_utilization": s.flags.get("gpu_memory_utilization"), "device": s.device,
                  "kv_cache_size_tokens": tokens,
                  "kv_cache_max_concurrency": round(tokens / s.max_model_len, 2) if s.max_model_len else 0}
        if info is None:
            info = GaugeMetricFamily(V + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*LABELS, *config])
        info.add_metric([model, engine, *(str(v) for v in config.values())], 1)
    return info
