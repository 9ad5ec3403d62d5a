"""The Responses store through a live server with small bounds: what a client sends along in an input item
beyond what is rendered is not kept, a conversation over the bound for one entry is refused with a 400 naming
it, a response over it says `store` false, and one user's many responses do not push out another user's."""

from __future__ import annotations

import json

import httpx
import pytest

from nanoserve.server import response_store
from tests.helpers import tiny_server_running

ENTRY_BYTES = 6 * 1024


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(response_store, "MAX_ENTRY_BYTES", ENTRY_BYTES)
        patch.setattr(response_store, "MAX_KEPT", 6)
        with tiny_server_running(tiny_checkpoint("llama")) as s:
            yield s


def _respond(server, **fields) -> httpx.Response:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def test_unrendered_keys_of_input_items_are_not_kept(server):
    junk = "j" * 2**20
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi", "junk": junk}],
            "junk": junk, "status": junk}
    r = _respond(server, input=[item])
    assert r.status_code == 200 and r.json()["store"] is True, r.text[:300]
    listed = httpx.get(f"{server.url}/v1/responses/{r.json()['id']}/input_items", timeout=30)
    assert listed.status_code == 200 and len(listed.content) < 1000, len(listed.content)
    (kept,) = listed.json()["data"]
    assert "junk" not in kept and "status" not in kept and kept["content"] == [{"type": "input_text", "text": "Hi"}]


def test_a_conversation_over_the_entry_bound_is_refused_naming_it(server):
    r = _respond(server, input="word " * ENTRY_BYTES)
    assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text[:300]
    assert f"{ENTRY_BYTES:,} bytes" in r.text and "store false" in r.text
    assert _respond(server, input="word " * ENTRY_BYTES, store=False).json()["error"]["param"] != "store"


def test_a_response_over_the_entry_bound_says_store_false(server):
    """Its metadata is in the response, not the conversation: the turn runs, and the response is not kept."""
    metadata = {f"k{i}": "v" * 500 for i in range(16)}
    r = _respond(server, metadata=metadata)
    assert r.status_code == 200 and r.json()["store"] is False, r.text[:300]
    assert httpx.get(f"{server.url}/v1/responses/{r.json()['id']}", timeout=30).status_code == 404
    streamed = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Hi", "max_output_tokens": 2, "metadata": metadata, "stream": True})
    last = [line for line in streamed.text.splitlines() if line.startswith("data: ")][-1]
    assert json.loads(last.removeprefix("data: "))["response"]["store"] is False


def test_one_users_many_responses_do_not_push_out_another_users(server):
    kept = _respond(server, user="bob").json()["id"]
    for _ in range(12):
        assert _respond(server, user="alice").status_code == 200
    assert httpx.get(f"{server.url}/v1/responses/{kept}", timeout=30).status_code == 200
