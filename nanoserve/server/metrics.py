"""Prometheus metrics: the server's own under a `nanoserve:` prefix (vLLM's names where one exists; the merged
snapshot's figures, refusals, speculative decoding, the optional features), and vLLM's whole `vllm:` family under
its own names, types, buckets and labels (vllm_metrics.py), which dashboards, routers and endpoint pickers read.

Counters and gauges are read from the engine's stats snapshot at scrape time (one source of truth);
latency histograms are observed per request from the timestamps its final output carries.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.outputs import RequestOutput
from nanoserve.server.vllm_metrics import vllm_families
from nanoserve.stats import EngineStats

P = "nanoserve:"
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
        yield from vllm_families(self.model, self.engines(), (s.features.get("refusals") or {}).get("admission"))
        for section, values in sorted(s.features.items()):  # optional features (inputs, buckets, capture)
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield gauge(f"{section}_{key}", f"{section}.{key} from the stats snapshot.", value)

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
