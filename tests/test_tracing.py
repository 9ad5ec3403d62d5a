"""OpenTelemetry traces (nanoserve/tracing.py): one span per request, its figures those of the request's own
timeline and outputs; through the SDK's in-memory exporter, and as a collector receives them over OTLP/HTTP on
loopback, decoded with opentelemetry-proto."""

from __future__ import annotations

import gzip
import http.server
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from nanoserve import LLM, SamplingParams
from tests.helpers import tiny_server_running

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from nanoserve.tracing import RequestTracer, protocol_for  # noqa: E402

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced_llm(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=256, kv_cache_gib=0.02,
              max_num_batched_tokens=32, max_num_seqs=8)
    exporter = InMemorySpanExporter()
    llm.engine.use_tracer(RequestTracer(exporter, batch=False))
    return llm, exporter


def test_one_span_per_request_with_the_figures_its_outputs_and_timeline_give(traced_llm):
    """Two requests (one with n=2, one with a prompt long enough for two chunks): a span each, whose token
    counts, finish reasons and latencies are the request's, and whose times are its timeline's."""
    llm, exporter = traced_llm
    exporter.clear()
    prompts = [[5, 6, 7, 8], [9 + i % 40 for i in range(60)]]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True),
                                  SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)], use_tqdm=False)
    spans = {span.attributes["gen_ai.request.id"]: span for span in exporter.get_finished_spans()}
    assert sorted(spans) == sorted(out.request_id for out in outs)
    for out in outs:
        span, a = spans[out.request_id], spans[out.request_id].attributes
        timelines = llm.engine.timelines.find(out.request_id, time.monotonic())
        kept = [t for t in llm.engine.timelines.recent if t.request_id == out.request_id]
        arrived = min(t.arrival for t in kept)  # each sequence arrived on its own, microseconds apart
        first_token = min(t.arrival + t.summary["ttft_s"] for t in kept)
        finished = max(t.arrival + t.summary["total_s"] for t in kept)
        assert span.name == "llm_request" and span.kind.name == "SERVER" and span.parent is None
        assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "nanoserve"
        assert a["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids) == a["gen_ai.usage.prompt_tokens"]
        made = sum(len(c.token_ids) for c in out.outputs)
        assert a["gen_ai.usage.output_tokens"] == made == a["gen_ai.usage.completion_tokens"]
        assert a["gen_ai.usage.num_sequences"] == len(out.outputs) == len(timelines)
        assert list(a["gen_ai.response.finish_reasons"]) == [c.finish_reason for c in out.outputs]
        m = out.metrics
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(first_token - arrived, abs=1e-9)
        # the metrics' times are the request's own (its n sequences share one arrival), the span's in microseconds
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(m.first_token_time - m.arrival_time,
                                                                        abs=5e-7)
        assert a["gen_ai.latency.e2e"] == pytest.approx(finished - arrived, abs=1e-9)
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(finished - arrived, abs=1e-8)
        scheduled = min(next(s.start for s in t.spans if s.kind != "queued") for t in kept)
        assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(first_token - scheduled, abs=1e-9)
        assert a["gen_ai.latency.time_in_queue"] == pytest.approx(
            sum(t["queued_s"] for t in timelines) / len(timelines), abs=1e-9)
        assert a["gen_ai.latency.time_in_model_decode"] + a["gen_ai.latency.time_in_model_prefill"] == \
            pytest.approx(a["gen_ai.latency.time_in_model_inference"], abs=2e-6)
        firsts = [e for e in span.events if e.name == "first_token"]
        assert len(firsts) == len(out.outputs)
        assert min(e.timestamp for e in firsts) - span.start_time == pytest.approx(
            a["gen_ai.latency.time_to_first_token"] * 1e9, abs=10)
    assert spans[outs[0].request_id].attributes["gen_ai.request.seed"] == 3
    long_prompt = llm.engine.timelines.find(outs[1].request_id, time.monotonic())[0]
    assert len([s for s in long_prompt["spans"] if s["kind"] == "prefill"]) > 1  # chunked, one span all the same


def test_an_aborted_request_still_ends_its_span_with_its_reason(traced_llm):
    llm, exporter = traced_llm
    exporter.clear()
    engine = llm.engine
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.id"] == rid
    assert list(span.attributes["gen_ai.response.finish_reasons"]) == ["abort"]


def test_the_protocol_follows_the_endpoint_as_vllm_reads_it_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert protocol_for("http://collector:4318/v1/traces") == "http/protobuf"
    assert protocol_for("collector:4317") == protocol_for("grpc://collector:4317") == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert protocol_for("collector:4318") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        protocol_for("collector:4318")


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: each POST to /v1/traces decoded as a collector would."""

    received: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
        self.received.append(ExportTraceServiceRequest.FromString(body))
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def test_a_server_exports_each_request_over_otlp_http_under_the_callers_trace(tiny_checkpoint, monkeypatch):
    """The real exporter, to a loopback receiver: the span arrives with the caller's trace id and parent (the
    W3C traceparent header), the served model name, the operation of the route, and the usage the response
    reported."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the batch goes out within 50 ms, not 5 s
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    _Collector.received = []
    receiver = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    try:
        with tiny_server_running(tiny_checkpoint("llama"), {"otlp_traces_endpoint": endpoint}) as server:
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                           json={"model": "tiny", "prompt": "a secret plan", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            deadline = time.monotonic() + 20
            while not _Collector.received and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        receiver.shutdown()
    (export,) = _Collector.received
    (resource_spans,) = export.resource_spans
    resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
    assert resource["service.name"] == "nanoserve"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    a = {kv.key: _value(kv.value) for kv in span.attributes}
    assert span.name == "llm_request" and span.kind == 2  # SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.id"] == body["id"]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert "secret" not in json.dumps(a)  # no text leaves: metadata only
    assert not any(body["choices"][0]["text"] and body["choices"][0]["text"] in str(v) for v in a.values())


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported(tiny_checkpoint):
    code = (f"import sys; from nanoserve import LLM, SamplingParams; "
            f"llm = LLM(model={str(tiny_checkpoint('llama'))!r}, max_model_len=64, kv_cache_gib=0.01); "
            "llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_a_bare_host_port_endpoint_exports_over_otlp_grpc_as_vllm_does(tiny_checkpoint, monkeypatch):
    """vLLM's documented form, host:4317, reaches a loopback gRPC trace service (the collector's own service
    definition from opentelemetry-proto)."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the service's name)
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")  # loopback, no TLS
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    service = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), service)
    port = service.add_insecure_port("127.0.0.1:0")
    service.start()
    try:
        llm = LLM(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01,
                  otlp_traces_endpoint=f"127.0.0.1:{port}")
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        llm.engine.close()  # sends what is batched
    finally:
        service.stop(None)
    spans = [s for export in received for rs in export.resource_spans for scope in rs.scope_spans
             for s in scope.spans]
    (span,) = spans
    a = {kv.key: _value(kv.value) for kv in span.attributes}
    assert a["gen_ai.request.id"] == out.request_id and a["gen_ai.usage.output_tokens"] == 3
