"""A body that is not JSON is a 400 saying what json.loads found wrong and where (line, column, char), with no
field named as its param: on every POST route, and in Anthropic's shape on /v1/messages."""

from __future__ import annotations

import httpx
import pytest

BROKEN = '{"prompt": "hi", "max_tokens": 4 "temperature": 0}'  # a missing comma after the 4, char 33
WHAT = "request body is not valid JSON: Expecting ',' delimiter at line 1, column 34 (char 33)"
OPENAI_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path", OPENAI_ROUTES)
def test_malformed_json_says_what_and_where_on_every_route(tiny_server, path):
    answer = httpx.post(f"{tiny_server.url}{path}", content=BROKEN, headers=JSON)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == WHAT
    assert error["param"] is None and error["type"] == "invalid_request_error"


def test_the_line_and_column_find_the_mistake_in_a_pretty_printed_body(tiny_server):
    body = '{\n  "prompt": "hi"\n  "max_tokens": 4\n}'  # the comma missing at the end of line 2
    answer = httpx.post(f"{tiny_server.url}/v1/completions", content=body, headers=JSON)
    assert answer.json()["error"]["message"] == ("request body is not valid JSON: Expecting ',' delimiter at line "
                                                 "3, column 3 (char 21)")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_malformed_json_on_the_messages_routes_is_in_anthropics_shape(tiny_server, path):
    answer = httpx.post(f"{tiny_server.url}{path}", content=BROKEN, headers=JSON)
    assert answer.status_code == 400
    assert answer.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": WHAT}}


def test_the_knobs_route_parses_its_own_body_and_says_the_same(tiny_server):
    answer = httpx.post(f"{tiny_server.url}/knobs", content='{"max_num_seqs" 8}', headers=JSON)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(
        "request body is not valid JSON: Expecting ':' delimiter at line 1, column 17 (char 16)")


def test_a_body_that_is_not_utf8_says_so(tiny_server):
    answer = httpx.post(f"{tiny_server.url}/v1/completions", content=b'{"prompt": "\xff"}', headers=JSON)
    assert answer.status_code == 400
    assert "not valid JSON" in answer.json()["error"]["message"] and "UTF-8" in answer.json()["error"]["message"]
