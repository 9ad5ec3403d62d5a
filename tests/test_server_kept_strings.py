"""The free strings a request leaves behind it (`user`, `request_id`, `session_id`, `cache_salt`, a stored
response's metadata) are bounded at the door: over the bound is a 400 naming the field and the limit, with no
echo of the value, so /health's rows (each live and latest finished request with its user and session) stay
small however large the users callers send."""

from __future__ import annotations

import httpx
import pytest

from nanoserve.server.protocol import MAX_ID_CHARS, MAX_USER_CHARS
from nanoserve.timeline import FINISHED_ROWS

MEGABYTE = "u" * 2**20
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
ROUTES = {  # route -> (a body, how the body names its user)
    "/v1/chat/completions": (CHAT, lambda user: {"user": user}),
    "/v1/completions": ({"model": "tiny", "prompt": "Hi", "max_tokens": 1}, lambda user: {"user": user}),
    "/v1/responses": ({"model": "tiny", "input": "Hi", "max_output_tokens": 1}, lambda user: {"user": user}),
    "/v1/messages": ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                     lambda user: {"metadata": {"user_id": user}}),
}


def _refused(server, route: str, body: dict, field: str, limit: int) -> None:
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400, (route, field, r.text[:300])
    assert len(r.content) < 1000, "the error echoes the value"
    message = r.text
    assert field in message and f"at most {limit}" in message and f"{2**20:,} characters" in message, message


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_megabyte_user_is_refused_on_every_route(tiny_server, route):
    base, named = ROUTES[route]
    _refused(tiny_server, route, {**base, **named(MEGABYTE)}, "user", MAX_USER_CHARS)
    fine = httpx.post(tiny_server.url + route, json={**base, **named("u" * MAX_USER_CHARS)}, timeout=60)
    assert fine.status_code == 200, fine.text[:300]


@pytest.mark.parametrize("field, limit", [("request_id", MAX_ID_CHARS), ("session_id", MAX_ID_CHARS),
                                          ("cache_salt", MAX_USER_CHARS)])
def test_megabyte_ids_and_salts_are_refused(tiny_server, field, limit):
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        _refused(tiny_server, route, {**ROUTES[route][0], field: MEGABYTE}, field, limit)


def test_a_responses_safety_identifier_and_metadata_take_openais_bounds(tiny_server):
    body = ROUTES["/v1/responses"][0]
    _refused(tiny_server, "/v1/responses", {**body, "safety_identifier": MEGABYTE}, "safety_identifier", 64)
    r = httpx.post(tiny_server.url + "/v1/responses", json={**body, "metadata": {"k": MEGABYTE}}, timeout=30)
    assert r.status_code == 400 and "at most 512" in r.text and len(r.content) < 1000, r.text[:300]
    r = httpx.post(tiny_server.url + "/v1/responses", json={**body, "metadata": {MEGABYTE: "v"}}, timeout=30)
    assert r.status_code == 400 and "at most 64" in r.text and len(r.content) < 1000, r.text[:300]


def test_health_stays_small_after_requests_with_the_largest_users(tiny_server):
    """Every request tries a megabyte user, session and request id; what is kept is at most the bounds, so each
    finished row is about a kilobyte and /health at most FINISHED_ROWS of them."""
    for i in range(6):
        for user in (MEGABYTE, f"{i}".ljust(MAX_USER_CHARS, "u")):
            httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
                **CHAT, "user": user, "session_id": f"{i}".ljust(MAX_ID_CHARS, "s"),
                "request_id": f"{i}-{user[:8]}".ljust(MAX_ID_CHARS, "r")})
    health = httpx.get(tiny_server.url + "/health", timeout=30)
    rows = health.json()["finished_rows"]
    assert any(len(row["user"] or "") == MAX_USER_CHARS for row in rows)
    largest = max(len(httpx.Request("GET", "/", json=row).content) for row in rows)
    assert largest < 2 * (MAX_USER_CHARS + 3 * MAX_ID_CHARS), largest
    assert len(health.content) < 100_000 + FINISHED_ROWS * largest, len(health.content)


def test_unknown_field_names_are_logged_clipped_and_remembered_within_a_bound(tiny_server, monkeypatch):
    from nanoserve.server import context

    monkeypatch.setattr(context, "_warned", {})  # the process's own, as other tests left it, comes back after
    for batch in range(3):
        extra = {f"{batch}-{i}-".ljust(1000, "x"): 1 for i in range(60)} | {MEGABYTE + str(batch): 1}
        r = httpx.post(tiny_server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
        assert r.status_code == 200, r.text[:300]
    assert len(context._warned) <= context.WARNED_MAX
    assert max(len(name) for name in context._warned) <= context.NAME_KEPT
