"""The Responses store's bounds and its fairness: one entry, all entries in bytes and in count; a caller who
stores many or large responses pushes out its own before another user's; the byte accounting follows every put
and delete. The store is cheap, so these drive the real one; tests/test_responses_store_live.py drives it through
a server."""

from __future__ import annotations

from nanoserve.server.response_store import ResponseStore, json_size

KB = 1024


def _response(rid: str, text: str = "") -> tuple[dict, list[dict]]:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return {"id": rid, "object": "response", "output": output}, [{"role": "user", "content": "Hi"}, *output]


def _put(store: ResponseStore, rid: str, owner: str, text: str = "") -> bool:
    response, conversation = _response(rid, text)
    return store.put(response, conversation, owner)


def test_one_callers_many_responses_do_not_evict_another_users():
    store = ResponseStore(max_kept=10)
    assert _put(store, "resp_b", "bob")
    for i in range(50):
        assert _put(store, f"resp_a{i}", "alice")
    assert store.get("resp_b") is not None
    assert store.held_by("alice")[0] == 9 and store.get("resp_a49") is not None and store.get("resp_a40") is None


def test_one_callers_huge_responses_do_not_evict_another_users():
    store = ResponseStore(max_bytes=1000 * KB, max_entry_bytes=300 * KB)
    assert _put(store, "resp_b", "bob", "b" * 40 * KB)
    assert _put(store, "resp_anon", "", "c" * KB)  # no user: the anonymous callers' share
    for i in range(40):  # each about 240 KB: its text is in the conversation and in the response's output
        assert _put(store, f"resp_a{i}", "alice", "a" * 120 * KB)
    assert store.get("resp_b") is not None and store.get("resp_anon") is not None
    assert store.size <= store.max_bytes
    entries, held = store.held_by("alice")
    assert entries == 3 and held <= store.max_bytes - store.held_by("bob")[1]


def test_the_biggest_holder_goes_first_whoever_adds():
    """bob, adding within his share, pushes out the oldest of alice, who holds the most."""
    store = ResponseStore(max_kept=4)
    for i in range(3):
        _put(store, f"resp_a{i}", "alice")
    _put(store, "resp_b0", "bob")
    _put(store, "resp_b1", "bob")
    assert store.get("resp_a0") is None and store.get("resp_a1") is not None
    assert store.held_by("alice")[0] == 2 and store.held_by("bob")[0] == 2


def test_an_entry_over_its_bound_is_not_kept():
    store = ResponseStore(max_entry_bytes=10 * KB)
    assert not _put(store, "resp_big", "alice", "x" * 10 * KB)
    assert store.get("resp_big") is None and store.size == 0 and store.held_by("alice") == (0, 0)


def test_the_byte_accounting_follows_puts_and_deletes():
    store = ResponseStore()
    response, conversation = _response("resp_1", "one")
    store.put(response, conversation, "alice")
    first = store.get("resp_1")
    assert first.conversation_bytes == json_size(conversation)
    assert store.size == first.size == json_size(conversation) + json_size(response)
    more = [{"role": "user", "content": "and more"}]
    grown = store.conversation_bytes(first, more)  # the prior's bytes are not measured again
    assert grown == first.conversation_bytes + json_size(more)
    second, _ = _response("resp_2", "two")
    store.put(second, first.conversation + more, "bob", grown)
    assert store.size == first.size + grown + json_size(second)
    store.put(response, conversation, "alice")  # the same id again replaces it
    assert store.held_by("alice") == (1, first.size)
    assert store.delete("resp_1") and store.delete("resp_2") and not store.delete("resp_2")
    assert store.size == 0 and store.held_by("alice") == (0, 0)


def test_entries_past_their_age_go():
    store = ResponseStore(max_age_s=0.0)
    _put(store, "resp_old", "alice")
    assert store.get("resp_old") is None and store.size == 0
