"""Prometheus metrics under vLLM's names with a `nanoserve:` prefix, so vLLM dashboards need little change; and the
four that Kubernetes routers scrape to pick an endpoint (llm-d, the Gateway API Inference Extension) under vLLM's
own `vllm:` names, types and labels (`model_name`, and `engine`, vLLM's engine index: one series per
data-parallel replica, "0" for a single engine).

Counters and gauges are read from the engine's stats snapshot at scrape time (one source of truth);
latency histograms are observed per request from the timestamps its final output carries.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.outputs import RequestOutput
from nanoserve.stats import EngineStats

P = "nanoserve:"
ROUTER = "vllm:"  # the names routers built around vLLM read
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class _SnapshotCollector:
    def __init__(self, stats: Callable[[], EngineStats], model: str,
                 engines: Callable[[], list[tuple[str, EngineStats]]] | None = None):
        self.stats, self.model = stats, model
        self.engines = engines or (lambda: [("0", self.stats())])

    def collect(self):
        s = self.stats()
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.scheduler.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.scheduler.waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv.usage)
        yield counter("num_preemptions", "Requests preempted by recompute.", s.scheduler.preemptions)
        yield counter("prompt_tokens", "Prompt tokens prefilled.", s.scheduler.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.scheduler.generation_tokens_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache.queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from cached blocks.", s.prefix_cache.hits)
        success = CounterMetricFamily(P + "request_success", "Finished requests by reason.",
                                      labels=[*labels, "finished_reason"])
        for reason, n in sorted(s.scheduler.finished.items()):
            success.add_metric([self.model, reason], n)
        yield success
        refused = CounterMetricFamily(P + "request_refused", "Generation requests refused before reaching the "
                                      "engine, by HTTP status.", labels=[*labels, "status"])
        for status, n in (s.features.get("refusals") or {}).get("by_status", {}).items():
            refused.add_metric([self.model, status], n)
        yield refused
        yield from self._speculative(s.features.get("speculative"), counter)
        yield from self._for_routers(self.engines())
        for section, values in sorted(s.features.items()):  # optional features (inputs, buckets, capture)
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield gauge(f"{section}_{key}", f"{section}.{key} from the stats snapshot.", value)

    def _for_routers(self, engines: list[tuple[str, EngineStats]]):
        """vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc and vllm:cache_config_info, as vLLM's V1
        engine exports them: what an endpoint picker scrapes (load, KV use, and the pool's size in blocks), one
        series per engine (a data-parallel replica each)."""
        labels = ["model_name", "engine"]
        for name, doc, value in (("num_requests_running", "Number of requests in model execution batches.",
                                  lambda s: s.scheduler.running),
                                 ("num_requests_waiting", "Number of requests waiting to be processed.",
                                  lambda s: s.scheduler.waiting),
                                 ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  lambda s: s.kv.usage)):
            g = GaugeMetricFamily(ROUTER + name, doc, labels=labels)
            for engine, s in engines:
                g.add_metric([self.model, engine], value(s))
            yield g
        info = None
        for engine, s in engines:
            config = {"block_size": s.kv.block_size, "num_gpu_blocks": s.kv.blocks_total, "num_cpu_blocks": 0,
                      "cache_dtype": s.dtype, "enable_prefix_caching": s.prefix_cache.enabled,
                      "gpu_memory_utilization": s.flags.get("gpu_memory_utilization"), "device": s.device}
            if info is None:
                info = GaugeMetricFamily(ROUTER + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                         labels=[*labels, *config])
            info.add_metric([self.model, engine, *(str(v) for v in config.values())], 1)
        if info is not None:
            yield info

    def _speculative(self, spec: dict | None, counter):
        """vLLM's speculative-decoding counters (spec_decode_*), when speculation is on."""
        if not spec:
            return
        yield counter("spec_decode_num_drafts", "Draft runs verified.", spec["num_drafts"])
        yield counter("spec_decode_num_draft_tokens", "Drafted tokens verified.", spec["num_draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Drafted tokens kept.", spec["num_accepted_tokens"])
        per = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Drafted tokens kept, by their "
                                  "position in the draft.", labels=["model_name", "position"])
        for position, n in enumerate(spec["num_accepted_tokens_per_pos"]):
            per.add_metric([self.model, str(position)], n)
        yield per


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model: str,
                 engines: Callable[[], list[tuple[str, EngineStats]]] | None = None):
        """`stats`: the server's snapshot; `engines`: each engine's own with its index, for the vllm: series
        (default: the one snapshot as engine "0")."""
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_SnapshotCollector(stats, model, engines))

        def hist(name, doc):
            return Histogram(P + name, doc, ["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Mean time between output tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")

    def observe(self, final: RequestOutput) -> None:
        m = final.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.labels(self.model).observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(self.model).observe(m.first_token_time - m.arrival_time)
            n = len(final.outputs[0].token_ids)
            if n > 1:
                self.itl.labels(self.model).observe((m.finished_time - m.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
