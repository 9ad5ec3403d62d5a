"""schemathesis against the server's own /openapi.json: generated requests (valid and invalid) to every route,
with no 5xx and every answer conforming to the schema the server publishes (status code, content type,
headers, body). Bounded: a fixed seed, a few examples per operation and phase, one worker."""

from __future__ import annotations

from .support import client_tool, run_client

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance")
MAX_EXAMPLES = 15


def test_schemathesis_finds_no_server_error_or_schema_violation(client_env, live, tmp_path):
    schemathesis = client_tool(client_env, "schemathesis")
    mark = live.recorder.mark()
    run = run_client([schemathesis, "run", f"{live.url}/openapi.json", "--checks", CHECKS,
                      "--max-examples", MAX_EXAMPLES, "--seed", "1", "--workers", "1", "--generation-database",
                      "none", "--request-timeout", "60", "--no-color", "--continue-on-failure"],
                     tmp_path, timeout=400, check=False, live=live, mark=mark)
    assert run.returncode == 0, run.output[-6000:]
    seen = live.recorder.since(mark)
    assert not [e for e in seen if e.status is None or e.status >= 500], live.recorder.failures(mark)
    for route in ("/v1/completions", "/v1/chat/completions"):
        posts = [e for e in seen if e.method == "POST" and e.path == route]
        assert len(posts) >= MAX_EXAMPLES and any(e.status == 200 for e in posts), route
