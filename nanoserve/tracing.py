"""OpenTelemetry traces: one span per request, with the GenAI semantic conventions' attributes, sent over OTLP.

`--otlp-traces-endpoint URL` (vLLM's flag) turns it on. With no endpoint nothing here is imported and nothing is
exported. The span is built from the request's timeline (timeline.py) when its last sequence finishes, so tracing
adds no work to a step: its times are the ones the Requests table and request screen show.

Span and attributes follow vLLM (span "llm_request", kind SERVER, the `gen_ai.latency.*` figures, a parent taken
from the request's W3C `traceparent` / `tracestate` headers) plus the current GenAI names (`gen_ai.usage.input_tokens`
and `output_tokens`, `gen_ai.response.finish_reasons`, `gen_ai.operation.name`, `gen_ai.provider.name`). No prompt
or answer text is exported: a trace backend is not behind the server's API key.

The protocol: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL) when set; else an http:// or
https:// endpoint is OTLP/HTTP (protobuf, the URL taken as given, e.g. http://collector:4318/v1/traces), and a bare
host:port or grpc:// one is OTLP/gRPC as in vLLM (e.g. collector:4317).
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
import time
from dataclasses import dataclass, field

from nanoserve.optional import require

log = logging.getLogger("nanoserve.tracing")
SPAN_NAME = "llm_request"  # vLLM's: dashboards built on vLLM's traces find ours
TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True)
class TraceOrigin:
    """Where a request came from, as its span says: its trace headers, the API operation it was, and the model
    name it was served under (the engine's own name for its model when None)."""

    headers: dict = field(default_factory=dict)
    operation: str = "text_completion"
    model: str | None = None


# The server sets this for the request being handled; EngineHost reads it when the request is queued (the
# route's own task), so no route passes headers along by hand. Offline, it stays at its default.
current_origin: contextvars.ContextVar[TraceOrigin | None] = contextvars.ContextVar("trace_origin", default=None)


def operation_of(path: str) -> str:
    """The GenAI operation name of an API route."""
    return "text_completion" if path.endswith("/completions") and "chat" not in path else "chat"


def protocol_for(endpoint: str) -> str:
    """'grpc' or 'http/protobuf' for `endpoint` (see the module's docstring)."""
    chosen = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if chosen:
        if chosen not in ("grpc", "http/protobuf"):
            raise ValueError(f"OTLP protocol {chosen!r} is not supported here: use grpc or http/protobuf")
        return chosen
    return "http/protobuf" if endpoint.startswith(("http://", "https://")) else "grpc"


def span_exporter(endpoint: str):
    """The OTLP exporter for `endpoint`; a missing package is one line naming the extra."""
    if protocol_for(endpoint) == "grpc":
        module = require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "--otlp-traces-endpoint over gRPC")
        return module.OTLPSpanExporter(endpoint=endpoint.removeprefix("grpc://"))
    module = require("opentelemetry.exporter.otlp.proto.http.trace_exporter", "--otlp-traces-endpoint over HTTP")
    return module.OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Turns finished requests' timelines into spans on its own TracerProvider (never the process's global one,
    so an application that embeds the engine keeps its own tracing as it set it up)."""

    def __init__(self, exporter, model: str | None = None, batch: bool = True):
        """`model`: the name spans give; the engine sets its model's when left None."""
        trace = require("opentelemetry.sdk.trace", "--otlp-traces-endpoint")
        export = require("opentelemetry.sdk.trace.export", "--otlp-traces-endpoint")
        resources = require("opentelemetry.sdk.resources", "--otlp-traces-endpoint")
        # the API comes with the SDK (its dependency; fastapi may bring it alone too)
        self._api = importlib.import_module("opentelemetry.trace")
        self._propagator = importlib.import_module(
            "opentelemetry.trace.propagation.tracecontext").TraceContextTextMapPropagator()
        processor = export.BatchSpanProcessor(exporter) if batch else export.SimpleSpanProcessor(exporter)
        self.provider = trace.TracerProvider(resource=resources.Resource.create({"service.name": "nanoserve"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("nanoserve")
        self.model = model
        self.exported = 0

    @classmethod
    def to_endpoint(cls, endpoint: str) -> RequestTracer:
        tracer = cls(span_exporter(endpoint))
        log.info("exporting one span per request to %s over OTLP (%s)", endpoint, protocol_for(endpoint))
        return tracer

    def request_done(self, timelines: list, origin: TraceOrigin | None) -> None:
        """Export the span of one request, whose sequences' timelines these are (n of them)."""
        origin = origin or TraceOrigin()
        parent = self._propagator.extract(origin.headers) if origin.headers else None
        wall = _WallClock()
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._api.SpanKind.SERVER,
                                      start_time=wall.ns(min(t.arrival for t in timelines)),
                                      attributes=self._attributes(timelines, origin))
        for timeline in timelines:
            for event, at in _events(timeline):
                span.add_event(event, {"gen_ai.sequence": timeline.name}, timestamp=wall.ns(at))
        if any(t.summary["finish_reason"] == "error" for t in timelines):
            span.set_status(self._api.Status(self._api.StatusCode.ERROR, "the step computing it failed"))
        span.end(end_time=wall.ns(max(_finished_at(t) for t in timelines)))
        self.exported += 1

    def _attributes(self, timelines: list, origin: TraceOrigin) -> dict:
        """Times across the request's sequences (each has its own arrival, microseconds apart): from the
        first arrival, to the first token any made, to the last finish."""
        first, summaries = timelines[0], [t.summary for t in timelines]
        params, arrived = first.params, min(t.arrival for t in timelines)
        scheduled = min(_scheduled_at(t) for t in timelines)
        firsts = [t.arrival + t.summary["ttft_s"] for t in timelines if t.summary["ttft_s"] is not None]
        finished = max(_finished_at(t) for t in timelines)
        made = sum(s["output_tokens"] for s in summaries)
        model = origin.model or self.model
        attributes = {
            "gen_ai.operation.name": origin.operation, "gen_ai.provider.name": "nanoserve",
            "gen_ai.request.model": model, "gen_ai.response.model": model,
            "gen_ai.request.id": first.request_id, "gen_ai.response.id": first.request_id,
            "gen_ai.request.n": params["n"], "gen_ai.usage.num_sequences": len(timelines),
            "gen_ai.request.temperature": params["temperature"], "gen_ai.request.top_p": params["top_p"],
            "gen_ai.request.top_k": params["top_k"], "gen_ai.request.max_tokens": params["max_tokens"],
            "gen_ai.usage.input_tokens": first.prompt_tokens, "gen_ai.usage.output_tokens": made,
            "gen_ai.usage.prompt_tokens": first.prompt_tokens, "gen_ai.usage.completion_tokens": made,
            "gen_ai.response.finish_reasons": [s["finish_reason"] or "abort" for s in summaries],
            "gen_ai.latency.time_in_queue": sum(s["queued_s"] for s in summaries) / len(summaries),
            "gen_ai.latency.e2e": finished - arrived,
            "gen_ai.latency.time_in_model_inference": finished - scheduled,
            "nanoserve.usage.cached_tokens": max(s["cached_tokens"] for s in summaries),
            "nanoserve.preemptions": sum(s["preemptions"] for s in summaries),
        }
        if params["seed"] is not None:
            attributes["gen_ai.request.seed"] = params["seed"]
        if firsts:
            attributes |= {"gen_ai.latency.time_to_first_token": min(firsts) - arrived,
                           "gen_ai.latency.time_in_model_prefill": min(firsts) - scheduled,
                           "gen_ai.latency.time_in_model_decode": finished - min(firsts)}
        drafted = sum(s["drafted"] for s in summaries)
        if drafted:
            attributes |= {"nanoserve.speculative.drafted": drafted,
                           "nanoserve.speculative.kept": sum(s["kept"] for s in summaries)}
        return {k: v for k, v in attributes.items() if v is not None}

    def close(self) -> None:
        """Send what is batched, then stop the exporter."""
        self.provider.shutdown()


class _WallClock:
    """Monotonic seconds (the timelines' clock) as wall-clock nanoseconds (OTLP's), read once per span."""

    def __init__(self):
        self._wall, self._mono = time.time_ns(), time.monotonic()

    def ns(self, monotonic: float) -> int:
        return self._wall - round((self._mono - monotonic) * 1e9)


def _scheduled_at(timeline) -> float:
    """When it first left the queue (its first span that is not the wait)."""
    return next((s.start for s in timeline.spans if s.kind != "queued"), _finished_at(timeline))


def _finished_at(timeline) -> float:
    return timeline.arrival + timeline.summary["total_s"]


def _events(timeline):
    """The instants worth a span event: the first token, each preemption, the finish."""
    if timeline.summary["ttft_s"] is not None:
        yield "first_token", timeline.arrival + timeline.summary["ttft_s"]
    for span in timeline.spans:
        if span.kind == "preempted":
            yield "preempted", span.start
