"""Malformed text and oversized grammars are refused with a 400 that names the field or the limit, and no error
body carries a traceback, a compiler's panic or more than a slice of what the caller sent."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from nanoserve.structured.params import MAX_CHOICES
from tests.helpers import tiny_server_running

TINY = {"model": "tiny", "max_tokens": 2, "temperature": 0}
HI = [{"role": "user", "content": "hi"}]
LONE = "\ud800"  # half of a surrogate pair, alone: JSON can spell it, UTF-8 cannot


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama")) as s:
        yield s


def _post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    """`body` as JSON with every non-ASCII character escaped, so a lone surrogate travels as `\\ud800`."""
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=timeout,
                      headers={"content-type": "application/json"})


# (route, body with a lone surrogate somewhere, the field the 400 must name)
CASES = [
    ("/v1/completions", {**TINY, "prompt": f"a{LONE}b"}, "prompt"),
    ("/v1/completions", {**TINY, "prompt": ["fine", LONE]}, "prompt[1]"),
    ("/v1/completions", {**TINY, "prompt": "hi", "stop": ["ok", LONE]}, "stop[1]"),
    ("/v1/completions", {**TINY, "prompt": "hi", "guided_regex": f"[a{LONE}]"}, "guided_regex"),
    ("/v1/completions", {**TINY, "prompt": "hi", "guided_choice": ["yes", LONE]}, "guided_choice[1]"),
    ("/v1/chat/completions", {**TINY, "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/chat/completions", {**TINY, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/tokenize", {"model": "tiny", "prompt": LONE}, "prompt"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/responses", {"model": "tiny", "input": LONE, "max_output_tokens": 2}, "input"),
]


@pytest.mark.parametrize("route,body,field", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, field):
    before = httpx.get(server.url + "/health").json()["scheduler"]["prompt_tokens_total"]
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"]
    assert message.startswith(f"{field} contains a lone UTF-16 surrogate (\\ud800); send valid Unicode"), message
    assert httpx.get(server.url + "/health").json()["scheduler"]["prompt_tokens_total"] == before


def test_a_surrogate_pair_is_text_not_an_error(server):
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": "smile \U0001F600"})  # sent as \ud83d\ude00
    assert r.status_code == 200 and r.json()["tokens"]


def test_a_huge_choice_list_is_refused_at_once_naming_the_limit(server):
    started = time.monotonic()
    r = _post(server, "/v1/completions", {**TINY, "prompt": "hi", "guided_choice": [f"c{i}" for i in range(100_000)]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"has 100,000 entries; the limit is {MAX_CHOICES:,}" in message
    assert time.monotonic() - started < 30  # a refusal, not a compile (which took over a minute)


@pytest.mark.parametrize("field,value,limit", [("guided_regex", "a" * 20_000, "10,000"),
                                               ("guided_grammar", "start: " + '"a" ' * 40_000, "100,000"),
                                               ("guided_json", {"type": "object", "description": "d" * 200_000},
                                                "100,000")], ids=["regex", "grammar", "schema"])
def test_an_oversized_grammar_input_is_refused_naming_the_limit(server, field, value, limit):
    r = _post(server, "/v1/completions", {**TINY, "prompt": "hi", field: value})
    assert r.status_code == 400 and f"the limit is {limit}" in r.json()["error"]["message"], r.text[:300]


def test_a_compiler_panic_reaches_the_log_not_the_caller(caplog):
    """What llguidance said on 100,000 choices (before they were bounded): a panic with its backtrace."""
    from nanoserve.server.protocol import error_body
    from nanoserve.structured.grammars import _reason

    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
             "   0: <unknown>\n  16: type_call\n             at ./Objects/typeobject.c:1091:11")
    with caplog.at_level(logging.WARNING, logger="nanoserve.structured"):
        said = _reason(panic)
    assert "panic" not in said and "backtrace" not in said and "too large or too complex" in said
    assert any("u16::MAX" in rec.getMessage() for rec in caplog.records)
    message = error_body(f"structured output choice is not usable: {panic}")["error"]["message"]
    assert "<backtrace>" not in message and "typeobject.c" not in message  # the net under every error body


def test_an_unexpected_failure_is_a_500_with_an_error_id_and_no_internals(server, caplog):
    tokenizer = server.host.engine.tokenizer
    real = tokenizer.encode

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal state at 0xdeadbeef\nTraceback (most recent call last): ...")

    tokenizer.encode = broken
    try:
        with caplog.at_level(logging.ERROR, logger="nanoserve.server"):
            r = _post(server, "/tokenize", {"model": "tiny", "prompt": "hello"})
    finally:
        tokenizer.encode = real
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "0xdeadbeef" not in message and "Traceback" not in message
    error_id = message.split("error id ")[1].split(")")[0]
    assert any(error_id in rec.getMessage() for rec in caplog.records)  # the operator finds it by the id


def test_an_error_echoes_only_a_slice_of_the_input(server):
    r = _post(server, "/v1/completions", {**TINY, "model": "m" * 100_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 500
    r = _post(server, "/v1/completions", {**TINY, "prompt": [{"x": "y" * 100_000}]})
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 1200
