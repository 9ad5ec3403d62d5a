"""A chat template is code the server runs: a request's own (--trust-request-chat-template) renders within a time
and size budget, a template that needs another one is refused, each a 400 that names the limit; and a
conversation whose client has left stops rendering, so departed callers cannot hold the rendering threads."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from nanoserve import template_budget
from nanoserve.server.context import PREPARE_THREADS

from .helpers import tiny_server_running, wait_until

HI = [{"role": "user", "content": "hi"}]
# each of three million loop items reads 8 MB: within every size limit, so only the clock (or the client
# leaving) ends it
SLOW = ("{% set big = 'x' * 8000000 %}{% for i in range(100000) %}{% for j in range(30) %}"
        "{% if big.count('y') %}{% endif %}{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server_running(tiny_checkpoint("llama"), trust_request_chat_template=True) as s:
        yield s


def post(server, route: str, template: str, timeout: float = 60) -> httpx.Response:
    body = {"messages": HI, "chat_template": template}
    if route == "/v1/chat/completions":
        body.update(model="tiny", max_tokens=1)
    return httpx.post(server.url + route, json=body, timeout=timeout)


def refusal(r: httpx.Response) -> str:
    """The 400's message, checked to be short and free of Python's internals."""
    assert r.status_code == 400, r.text[:300]
    assert len(r.text) < 1000 and "Traceback" not in r.text and 'File "' not in r.text
    return r.json()["error"]["message"]


ROUTES = ["/v1/chat/completions", "/tokenize"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("template,says", [
    ("{{ 'a' * 20000000 }}", "limit of 8,388,608 characters"),  # before: 103 s and +600 MB, then a prompt
    ("{% for i in range(100001) %}{% endfor %}", "range() of 100,001 items is over the chat template's limit"),
    ("{{ [0] * 2000000 }}", "limit of 1,000,000"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops took more than"),
    ("{{ 'ab' | center(100000000) }}", "100,000,000 is over the chat template's limit"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "limit of 8,388,608 characters"),
])
def test_a_request_template_that_builds_too_much_is_a_400_naming_the_limit(server, route, template, says):
    started = time.monotonic()
    message = refusal(post(server, route, template))
    assert says in message
    assert time.monotonic() - started < 30  # refused before it is built, not after


@pytest.mark.parametrize("template,says", [
    ("{{ ('%s' * 1000) % (('a' * 8000000,) * 1000) }}", "the arguments would be over"),  # before: 16 s, 8 GB
    ("{{ ('{:>8000000}' * 100).format(*range(100)) }}", "a format's fields (800,000,000 characters wide)"),
    ("{{ (range(100000) | list) | tojson(indent=8000000) }}", "the tojson text would be over"),
    ("{{ ('a\n' * 1000000) | indent(8000000) }}", "the text with its indent would be over"),
    ("{{ ('\t' * 1000000).expandtabs(8000000) }}", "the string with its tabs expanded would be over"),
    ("{{ ('a' * 8000000) | batch(1) | list }}", "would have 8,000,000 items"),
    ("{{ range(1000) | map('string') | map('center', 8000000) | list }}", "built more than 67,108,864 characters"),
])
def test_a_request_template_that_builds_too_much_in_steps_is_a_400(server, template, says):
    """Each step within its limit, the whole past it: refused before the whole is built."""
    started = time.monotonic()
    assert says in refusal(post(server, "/v1/chat/completions", template))
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("template,tag", [
    ("{% include 'other.jinja' %}", "include"),
    ("{% import 'macros.jinja' as m %}{{ m.x }}", "import"),
    ("{% from 'macros.jinja' import x %}{{ x }}", "from ... import"),
    ("{% extends 'base.jinja' %}", "extends"),
])
def test_a_request_template_may_not_load_another(server, route, template, tag):
    message = refusal(post(server, route, template))  # before: a 500 (there is no loader)
    assert f"{{% {tag} %}}" in message and "may not include, import or extend another" in message


def test_a_request_template_that_runs_past_its_time_is_a_400(server, monkeypatch):
    monkeypatch.setattr(template_budget, "LIMITS", template_budget.Limits(seconds=0.5))
    started = time.monotonic()
    message = refusal(post(server, "/v1/chat/completions", SLOW))
    assert "took longer than 0.5 s" in message
    assert time.monotonic() - started < 30


def test_a_request_template_that_fails_is_a_short_400(server):
    message = refusal(post(server, "/v1/chat/completions", "{{ 1 / 0 }}" + "x" * 5000))
    assert "ZeroDivisionError" in message and len(message) < 500


@pytest.mark.parametrize("route", ROUTES)
def test_callers_who_leave_mid_render_do_not_hold_the_rendering_threads(server, route, monkeypatch):
    """Twice as many callers as rendering threads send a template that renders for a minute and leave after
    a second: a plain request after them is answered at once, not after their renders."""
    monkeypatch.setattr(template_budget, "LIMITS", template_budget.Limits(seconds=60))

    def leave():
        with pytest.raises(httpx.ReadTimeout):
            post(server, route, SLOW, timeout=1.0)

    callers = [threading.Thread(target=leave) for _ in range(2 * PREPARE_THREADS)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=20,  # the renders it came after: 60 s each
                   json={"model": "tiny", "messages": HI, "max_tokens": 2})
    assert r.status_code == 200

    def all_blocks_free() -> bool:
        kv = httpx.get(server.url + "/health").json()["kv"]
        return kv["blocks_free"] == kv["blocks_total"]

    assert wait_until(all_blocks_free, timeout=5)
