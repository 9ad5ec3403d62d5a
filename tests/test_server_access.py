"""What a caller without the API key can read: every route walked with no key, a wrong key and the right one,
against a table of what each may answer. A route the server has and the table lacks fails the walk, so a route
added later has to declare itself here (and in nanoserve/server/access.py)."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from starlette.routing import Route

from nanoserve.config import EngineConfig
from nanoserve.server.serve import Server
from tests.helpers import tiny_server_running

KEY = "s3cret"
USER = "alice@example.com"
TINY = {"model": "tiny", "max_tokens": 2, "temperature": 0}
# (method, path as routed): (what it answers without the key, the path to call, a body that it serves)
ROUTES = {
    ("GET", "/health"): ("liveness", "/health", None),
    ("GET", "/metrics"): ("open", "/metrics", None),
    ("GET", "/version"): ("open", "/version", None),
    ("GET", "/openapi.json"): ("open", "/openapi.json", None),
    ("GET", "/docs"): ("open", "/docs", None),
    ("GET", "/docs/oauth2-redirect"): ("open", "/docs/oauth2-redirect", None),
    ("GET", "/redoc"): ("open", "/redoc", None),
    ("GET", "/ping"): ("open", "/ping", None),  # status and reason: what /health tells anyone
    ("POST", "/ping"): ("open", "/ping", None),
    ("GET", "/load"): ("open", "/load", None),  # one count
    ("POST", "/reset_prefix_cache"): ("keyed", "/reset_prefix_cache", None),
    ("GET", "/v1/models"): ("keyed", "/v1/models", None),
    ("GET", "/v1/models/{model_id:path}"): ("keyed", "/v1/models/tiny", None),
    ("POST", "/tokenize"): ("keyed", "/tokenize", {"model": "tiny", "prompt": "hello"}),
    ("POST", "/detokenize"): ("keyed", "/detokenize", {"model": "tiny", "tokens": [1, 2, 3]}),
    ("GET", "/tokenizer_info"): ("keyed", "/tokenizer_info", None),
    ("POST", "/v1/completions"): ("keyed", "/v1/completions", {**TINY, "prompt": "hello", "user": USER,
                                                               "request_id": "walked"}),
    ("POST", "/v1/chat/completions"): ("keyed", "/v1/chat/completions",
                                       {**TINY, "messages": [{"role": "user", "content": "hi"}], "user": USER}),
    ("POST", "/invocations"): ("keyed", "/invocations", {**TINY, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions/batch"): ("keyed", "/v1/chat/completions/batch",
                                             {**TINY, "messages": [[{"role": "user", "content": "hi"}]]}),
    ("POST", "/v1/messages"): ("keyed", "/v1/messages", {"model": "tiny", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}],
                                                         "metadata": {"user_id": USER}}),
    ("POST", "/v1/messages/count_tokens"): ("keyed", "/v1/messages/count_tokens",
                                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses"): ("keyed", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                                           "user": USER, "request_id": "stored"}),
    ("GET", "/v1/responses/{response_id}"): ("keyed", None, None),  # the path of the response just stored
    ("GET", "/v1/responses/{response_id}/input_items"): ("keyed", None, None),
    ("POST", "/v1/responses/{response_id}/cancel"): ("keyed", None, None),  # 400 with the key: not background
    ("DELETE", "/v1/responses/{response_id}"): ("keyed", None, None),  # last: it forgets the response
    ("GET", "/knobs"): ("keyed", "/knobs", None),
    ("POST", "/knobs"): ("keyed", "/knobs", {"max_step_ms": None}),
    ("GET", "/requests"): ("keyed", "/requests", None),  # after the completions: it lists theirs
    ("GET", "/requests/{request_id}"): ("keyed", "/requests/cmpl-walked", None),
}
CALLERS = {"no key": {}, "a wrong key": {"Authorization": "Bearer nope"},
           "the key without Bearer": {"Authorization": KEY}, "a wrong x-api-key": {"x-api-key": "nope"},
           "the key with Bearer as x-api-key": {"x-api-key": f"Bearer {KEY}"}}


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), api_key=KEY) as s:
        yield s


def served_routes(app) -> set[tuple[str, str]]:
    return {(method, route.path) for route in app.routes if isinstance(route, Route)
            for method in route.methods - {"HEAD"}}


def call(server, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


def test_every_route_answers_what_its_row_allows(keyed_server):
    assert served_routes(keyed_server.app) == set(ROUTES), "declare the new route in ROUTES and access.py"
    right = {"Authorization": f"Bearer {KEY}"}
    stored = None
    for (method, route), (without_key, path, body) in ROUTES.items():
        if route.startswith("/v1/responses/{response_id}"):
            path = route.replace("{response_id}", stored)
        served = call(keyed_server, method, path, body, right)
        if route == "/v1/responses":
            stored = served.json()["id"]
        ok = 400 if route.endswith("/cancel") else 200  # only a background response can be cancelled
        assert served.status_code == ok, (path, served.text)
        if without_key == "keyed":  # Anthropic's header carries the same key (a DELETE done twice: 404)
            again = call(keyed_server, method, path, body, {"x-api-key": KEY}).status_code
            assert again == (404 if method == "DELETE" else ok), path
        for who, headers in CALLERS.items():
            r = call(keyed_server, method, path, body, headers)
            if without_key == "keyed":
                assert r.status_code == 401, (path, who, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
            elif without_key == "open":
                assert r.status_code == 200, (path, who, r.text)
                if path != "/metrics":  # its counters move between two calls
                    assert r.content == served.content, (path, who)
            else:  # liveness: whether it serves and why not, nothing of the snapshot
                assert r.status_code == 200 and set(r.json()) == {"status", "reason", "snapshot"}, (path, r.text)
                assert r.json()["status"] == "ok" and "API key" in r.json()["snapshot"]
                assert "model" in served.json() and "rows" in served.json()


def test_an_unknown_route_needs_the_key_before_it_is_named_missing(keyed_server):
    assert call(keyed_server, "GET", "/timeline", None, {}).status_code == 401
    found = call(keyed_server, "GET", "/timeline", None, {"Authorization": f"Bearer {KEY}"})
    assert found.status_code == 404


def test_who_is_running_what_is_readable_only_with_the_key(keyed_server):
    """A keyed client's stream is running, with its user; outsiders see neither it nor its user, in /health or
    /metrics, while the keyed snapshot lists both."""
    right = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "user": USER, "request_id": "secret-request"}
    seen_running, done = threading.Event(), threading.Event()

    def stream():
        with httpx.stream("POST", keyed_server.url + "/v1/completions", json=body, headers=right, timeout=60) as r:
            for _ in r.iter_lines():
                if not seen_running.is_set() and keyed_server.host.stats().rows:
                    seen_running.set()
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    assert seen_running.wait(30)
    outside = httpx.get(keyed_server.url + "/health").text + httpx.get(keyed_server.url + "/metrics").text
    inside = httpx.get(keyed_server.url + "/health", headers=right).json()
    assert done.wait(60)
    assert USER not in outside and "secret-request" not in outside
    assert any(row["user"] == USER and "secret-request" in row["request_id"] for row in inside["rows"])
    metrics = httpx.get(keyed_server.url + "/metrics", headers=right).text
    assert USER not in metrics and "secret-request" not in metrics  # no per-request label, key or no key


def test_a_server_open_beyond_loopback_says_so_once(tiny_checkpoint, caplog):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), max_model_len=128, kv_cache_gib=0.01)
    with caplog.at_level(logging.WARNING, logger="nanoserve.serve"):
        for host, key in (("0.0.0.0", None), ("127.0.0.1", None), ("0.0.0.0", KEY)):
            Server(config, host=host, port=0, api_key=key).stop()
    warned = [r.getMessage() for r in caplog.records if "without --api-key" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0] and "every route is open" in warned[0]
