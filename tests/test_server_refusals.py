"""Refused requests are counted where they are refused (the HTTP layer), by status, and published with the
stats: totals, per-second rates over the sliding windows, and a Prometheus counter."""

from __future__ import annotations

import asyncio

import httpx

from nanoserve.server.refusals import CountRefusals, Refusals


def refusals(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["refusals"]


def test_each_refusal_is_counted_once_by_its_status(tiny_server):
    url = tiny_server.url
    before = refusals(url)
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).status_code == 400
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "model": "other"}).status_code == 404
    streamed = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert streamed.status_code == 200
    httpx.post(f"{url}/tokenize", json={"prompt": 5})  # not a generation route: not counted
    after = refusals(url)
    assert after["total"] - before["total"] == 3
    grew = {k: after["by_status"].get(k, 0) - before["by_status"].get(k, 0) for k in after["by_status"]}
    assert {k: v for k, v in grew.items() if v} == {"400": 2, "404": 1}
    assert after["per_s"]["10s"] > 0 and set(after["per_s"]) == {"10s", "1m", "5m"}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'nanoserve:request_refused_total{model_name="tiny",status="404"}' in metrics


def test_a_server_error_is_not_a_refusal_and_the_windows_forget():
    """A 500 is a failed step (finish reason `error`), not a refusal; a refusal older than a window leaves it."""
    counted = Refusals()

    async def answer(status):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        async def send(message):
            pass

        await CountRefusals(app, counted)({"type": "http", "path": "/v1/completions"}, None, send)

    for status in (500, 503, 429, 200):
        asyncio.run(answer(status))
    snap = counted.snapshot()
    assert snap["by_status"] == {"429": 1, "503": 1} and snap["total"] == 2
    later = counted._started + 120  # two minutes on: out of the 10 s and 1 min windows, inside 5 min
    snap = counted.snapshot(later)
    assert snap["per_s"]["10s"] == 0 and snap["per_s"]["1m"] == 0 and snap["per_s"]["5m"] == round(2 / 120, 3)
