"""Agent frameworks against the live server: the OpenAI Agents SDK runs an agent with one function tool to
completion over the Responses API."""

from __future__ import annotations

import json

from .support import HERE, MODEL, run_client


def test_an_openai_agents_sdk_agent_calls_its_tool_and_finishes(client_env, live, tmp_path):
    out = tmp_path / "agents.json"
    mark = live.recorder.mark()
    run_client([client_env / "bin" / "python", HERE / "drivers" / "openai_agents.py", f"{live.url}/v1", MODEL, out],
               tmp_path, timeout=180, live=live, mark=mark)
    got = json.loads(out.read_text())
    assert got["calls"] == ["Paris"] or got["calls"] == ["Rome"]  # the tool ran once, with a city the schema allows
    assert got["items"][:2] == ["tool_call_item", "tool_call_output_item"]
    assert got["items"][-1] == "message_output_item" and isinstance(got["final_output"], str)
    sent = live.recorder.since(mark, "/v1/responses")
    assert len(sent) == len(got["responses"]) == 2 and all(e.status == 200 for e in sent)
    second = sent[1].request
    assert any(item.get("type") == "function_call_output" for item in second["input"])  # the tool's output went back
