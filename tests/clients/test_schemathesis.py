"""schemathesis against the server's own /openapi.json.

The CLI run sends generated requests (valid and invalid) to every route: no 5xx, and every answer conforms to the
published schema (status code, content type, headers, body). Bounded: a fixed seed, a few examples per operation
and phase, one worker. Generated requests seldom pass the server's semantic checks, so a second run holds the
answers to known-good requests (JSON and SSE, every route) to the same schema, and the document itself must
describe the success bodies: an empty schema would make every body conform.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from nanoserve import EngineConfig
from nanoserve.server.serve import Server

from .support import HERE, MODEL, LiveServer, Recorder, RecordingMiddleware, client_tool, run_client

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance")
MAX_EXAMPLES = 15
SHORT_CONTEXT = 64


@pytest.fixture(scope="module")
def short_live(tiny_dir):
    """A server whose contexts end at SHORT_CONTEXT tokens: a generated request that leaves `max_tokens` unset
    generates to the end of its context, and at 512 those took 3 s each, most of the run's time on a loaded
    machine. Every route and every check are the same."""
    server = Server(EngineConfig(model=str(tiny_dir), max_model_len=SHORT_CONTEXT, kv_cache_gib=0.02), port=0,
                    served_model_name=MODEL)
    recorder = Recorder()
    server.app.add_middleware(RecordingMiddleware, recorder=recorder)
    server.start()
    yield LiveServer(server, recorder, tiny_dir)
    server.stop()


def test_schemathesis_finds_no_server_error_or_schema_violation(client_env, short_live, tmp_path):
    live = short_live
    schemathesis = client_tool(client_env, "schemathesis")
    mark = live.recorder.mark()
    run = run_client([schemathesis, "run", f"{live.url}/openapi.json", "--checks", CHECKS,
                      "--max-examples", MAX_EXAMPLES, "--seed", "1", "--workers", "1", "--generation-database",
                      "none", "--request-timeout", "60", "--no-color", "--continue-on-failure"],
                     tmp_path, timeout=400, check=False, live=live, mark=mark)
    print(live.recorder.slowest(mark, count=15), file=sys.stderr)  # where its time went, shown when it fails
    assert run.returncode == 0, run.output[-6000:]
    seen = live.recorder.since(mark)
    assert not [e for e in seen if e.status is None or e.status >= 500], live.recorder.failures(mark)
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert len([e for e in seen if e.method == "POST" and e.path == route]) >= MAX_EXAMPLES, route


def test_schemathesis_validates_known_good_answers_on_every_route(client_env, live, tmp_path):
    out = tmp_path / "cases.json"
    mark = live.recorder.mark()
    run_client([client_env / "bin" / "python", HERE / "drivers" / "schemathesis_cases.py", live.url, MODEL, out],
               tmp_path, timeout=120, live=live, mark=mark)
    results = json.loads(out.read_text())
    failed = [f"{r['case']}: {r['failure']}" for r in results if r["failure"]]
    assert not failed, "\n\n".join(failed)
    assert all(r["status"] == 200 for r in results)


def test_openapi_document_describes_the_success_bodies(live):
    doc = httpx.get(f"{live.url}/openapi.json").json()
    empty = []
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses"):
        method = "post" if path != "/v1/models" else "get"
        schema = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        if not schema:
            empty.append(path)
    assert not empty, f"these routes document their 200 JSON body as {{}} (anything conforms): {empty}"
