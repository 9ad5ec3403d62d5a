"""guidellm: a short streaming benchmark against chat and completions, judged from its own report file.

guidellm exits 0 even when every request failed, so the verdict is read from the JSON report: no errored and no
incomplete request, each successful one with the output length it asked for (counted from the server's usage,
which it asks for on every chunk with stream_options.continuous_usage_stats).
"""

from __future__ import annotations

import json

import pytest

from .support import client_tool, run_client

REQUESTS = 4
OUTPUT_TOKENS = 8


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streaming_benchmark_has_no_errored_requests(client_env, live, tmp_path, route):
    guidellm = client_tool(client_env, "guidellm")
    report = tmp_path / "report.json"
    mark = live.recorder.mark()
    run_client([guidellm, "run",
                "--backend", f"kind=openai_http,target={live.url},request_format={route}",
                "--profile", "kind=concurrent,streams=2",
                "--constraint", f"kind=max_requests,count={REQUESTS}",
                "--data", f"kind=synthetic_text,prompt_tokens=24,output_tokens={OUTPUT_TOKENS}",
                "--tokenizer", f"kind=huggingface_auto,model={live.checkpoint}",
                "--output", f"kind=json,path={report}",
                "--disable-console-interactive"],
               tmp_path, timeout=240, live=live, mark=mark)
    benchmarks = json.loads(report.read_text())["benchmarks"]
    totals = [b["metrics"]["request_totals"] for b in benchmarks]
    errors = [r["info"]["error"] for b in benchmarks for r in b["requests"]["errored"]]
    assert all(t["errored"] == 0 and t["incomplete"] == 0 for t in totals), \
        f"{totals}\nguidellm's errors: {errors[:2]}\n{live.recorder.failures(mark)}"
    assert sum(t["successful"] for t in totals) == REQUESTS
    done = [r for b in benchmarks for r in b["requests"]["successful"]]
    assert [r["output_tokens"] for r in done] == [OUTPUT_TOKENS] * REQUESTS
    assert all(r["prompt_tokens"] > 0 and r["time_to_first_token_ms"] is not None for r in done)
    posts = live.recorder.since(mark, route)
    assert len(posts) == REQUESTS and all(e.status == 200 for e in posts)
    assert all(e.request["stream"] and e.request["stream_options"]["continuous_usage_stats"] for e in posts)
