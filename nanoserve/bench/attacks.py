"""What a hostile or careless caller does to a live server, each with what a sound server does about it.

Each attack is one async function over a `Target` (the server's URL, its API key, the in-process server for the
data-parallel listener) that returns an `Outcome`: whether the server held, and what it said, in words.
`nanoserve bench hostile` runs every one in turn beside normal traffic; `nanoserve bench soak` mixes them into its
clients. An attack that cannot run against this server (it needs --trust-request-chat-template, or data
parallelism) says so and is skipped, never counted as held.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

SETTLE_S = 30.0  # how long the server gets to end what an attack left running
BODY_WAIT_S = 120.0  # how long a stalled upload may stay open before the attack counts it as held forever


@dataclass
class Target:
    url: str
    api_key: str | None = None
    server: object | None = None  # the in-process nanoserve.server.serve.Server, for what HTTP cannot reach
    trusts_templates: bool = False

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def host_port(self) -> tuple[str, int]:
        address = httpx.URL(self.url)
        return address.host, address.port


@dataclass
class Outcome:
    held: bool | None  # None: skipped (the attack does not apply to this server)
    said: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


def on_purpose(message: str) -> str | None:
    """What a benchmark did on purpose that this error reports (a fault it injected, a replica it killed), or
    None: an error of any other cause is the server's own."""
    if "injected fault" in message:
        return "injected fault"
    if re.search(r"replica \d+ stopped", message):
        return "killed replica"
    return None


class Disrupted(Exception):
    """The benchmark's own disruption (a restart's 503, an injected fault, a killed replica) reached one of the
    attack's requests: the attack gives no verdict."""


def _disruption(status: int, message: str) -> bool:
    return status == 503 or (status >= 500 and on_purpose(message) is not None)


async def _raise_on_disruption(response: httpx.Response) -> None:
    if response.status_code >= 500:
        await response.aread()
        if _disruption(response.status_code, _error_message(response)):
            raise Disrupted(f"{response.status_code} {_error_message(response)[:120]}")


def attack_client(**kwargs) -> httpx.AsyncClient:
    """The HTTP client attacks run on: a response that reports the benchmark's own disruption raises Disrupted."""
    return httpx.AsyncClient(event_hooks={"response": [_raise_on_disruption]}, **kwargs)


def held(said: str, **details) -> Outcome:
    return Outcome(True, said, details=details)


def broke(said: str, **details) -> Outcome:
    return Outcome(False, said, details=details)


def skipped(why: str) -> Outcome:
    return Outcome(None, why)


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def _no_internals(text: str) -> bool:
    """An error body must not carry a traceback or a native panic."""
    return not any(mark in text for mark in ("Traceback", "panicked at", "RUST_BACKTRACE", 'File "/'))


# ---- the attacks ------------------------------------------------------------------------------------------
async def slow_bodies(t: Target, http: httpx.AsyncClient, count: int = 200) -> Outcome:
    """Connections that promise a 4 MB body to the open /health and send 10 bytes: a keyed request still gets
    its answer, and the server closes each within its body deadline."""
    host, port = t.host_port
    streams = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST /health HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 4000000\r\n\r\n{{\"a\": \"b".encode())
        await writer.drain()
        streams.append((reader, writer))
    try:
        r = await http.post(t.url + "/v1/completions", headers=t.headers, timeout=60,
                            json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        if r.status_code != 200:
            return broke(f"with {count} stalled uploads held, a keyed request got {r.status_code}: "
                         f"{_error_message(r)}")
        closed = await asyncio.gather(*(_closed_within(reader, BODY_WAIT_S) for reader, _ in streams))
    finally:
        for _, writer in streams:
            writer.close()
    if not all(closed):
        return broke(f"{closed.count(False)} of {count} stalled uploads were still open after {BODY_WAIT_S:.0f} s")
    return held(f"a keyed request answered beside {count} stalled uploads; the server closed every one")


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server ended the connection (an answer and a close, or a close) within `seconds`."""
    async def drain():
        while await reader.read(65536):
            pass

    try:
        await asyncio.wait_for(drain(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True


def wide_lark(n: int = 5_000) -> str:
    rng = random.Random(0)
    words = {"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(n)}
    return "start: " + " | ".join(f'"{w}"' for w in sorted(words))


async def failing_grammar(t: Target, http: httpx.AsyncClient) -> Outcome:
    """A grammar that compiles and then fails while generating, beside three other callers' streams: it alone
    ends (a 400), their streams finish with no error, and the open /health stays ok."""
    async def stream(prompt: str) -> list[dict]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        events = []
        async with http.stream("POST", t.url + "/v1/completions", json=body, headers=t.headers, timeout=120) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        return events

    streams = [asyncio.create_task(stream(p)) for p in ("The river", "Seven boats", "In the morning")]
    await asyncio.sleep(0.2)
    r = await http.post(t.url + "/v1/completions", headers=t.headers, timeout=120,
                        json={"prompt": "Say it", "max_tokens": 8, "guided_grammar": wide_lark()})
    others = await asyncio.gather(*streams)
    errors = [e["error"]["message"] for events in others for e in events if "error" in e]
    if any(on_purpose(message) for message in errors):
        raise Disrupted(f"a stream beside it: {errors[0][:120]}")
    health = await http.get(t.url + "/health")
    if r.status_code != 400:
        return broke(f"the failing grammar got {r.status_code}: {_error_message(r)[:160]}")
    if errors:
        return broke(f"other callers' streams ended with its error: {errors[0][:160]}")
    if health.json().get("status") != "ok":
        keyed = (await http.get(t.url + "/health", headers=t.headers)).json()
        if on_purpose(str(keyed.get("reason"))):
            raise Disrupted(f"/health {keyed.get('status')}: the benchmark's injected faults")
        return broke(f"the open /health says {health.json().get('status')}: {health.json().get('reason')}")
    return held(f"400 for it alone ({_error_message(r)[:80]}...); three streams finished; /health ok")


async def long_chat(t: Target, http: httpx.AsyncClient, messages: int = 800) -> Outcome:
    """A conversation of 800 short messages in a role outside OpenAI's set: answered (or refused) at the cost of
    one rendering, not 800."""
    convo = [{"role": "narrator" if i % 2 else "user", "content": f"line {i}"} for i in range(messages)]
    started = time.monotonic()
    r = await http.post(t.url + "/v1/chat/completions", headers=t.headers, timeout=120,
                        json={"messages": convo, "max_tokens": 1})
    seconds = time.monotonic() - started
    if r.status_code >= 500 or seconds > 5:
        return broke(f"{messages} messages: {r.status_code} after {seconds:.1f} s")
    return held(f"{messages} messages: {r.status_code} in {seconds:.2f} s")


async def abandoned_chats(t: Target, http: httpx.AsyncClient, callers: int = 4) -> Outcome:
    """Callers send 48 KB conversations and leave after a second: a plain request after them is not queued
    behind their renderings."""
    convo = [{"role": "narrator" if i % 2 else "user", "content": "x" * 40} for i in range(1000)]

    async def leave():
        try:
            await http.post(t.url + "/v1/chat/completions", headers=t.headers, timeout=1.0,
                            json={"messages": convo, "max_tokens": 1})
        except httpx.TimeoutException:
            pass

    await asyncio.gather(*(leave() for _ in range(callers)))
    started = time.monotonic()
    r = await http.post(t.url + "/v1/chat/completions", headers=t.headers, timeout=120,
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    seconds = time.monotonic() - started
    if r.status_code != 200 or seconds > 10:
        return broke(f"after {callers} abandoned conversations a plain chat took {seconds:.1f} s ({r.status_code})")
    return held(f"a plain chat after {callers} abandoned conversations: {seconds:.2f} s")


async def response_flood(t: Target, http: httpx.AsyncClient, count: int = 300) -> Outcome:
    """One user stores a response; another stores many with a 1 MB junk key in each input item: the first
    user's response survives, and the junk is not kept."""
    def body(user: str, junk: str = "") -> dict:
        item = {"type": "message", "role": "user", "content": "hi"}
        if junk:
            item["junk"] = junk
        return {"input": [item], "max_output_tokens": 1, "store": True, "user": user}

    mine = await http.post(t.url + "/v1/responses", headers=t.headers, json=body("alice"), timeout=60)
    if mine.status_code != 200:
        return broke(f"storing a plain response got {mine.status_code}: {_error_message(mine)}")
    junk = "j" * 2**20
    statuses: dict[int, int] = {}
    for _ in range(count):
        r = await http.post(t.url + "/v1/responses", headers=t.headers, json=body("mallory", junk), timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            return broke(f"a junk-laden response got {r.status_code}: {_error_message(r)}")
    back = await http.get(f"{t.url}/v1/responses/{mine.json()['id']}", headers=t.headers)
    if back.status_code != 200:
        return broke(f"after {count} junk-laden responses by another user, the first user's stored response "
                     f"answers {back.status_code}", statuses=statuses)
    return held(f"{count} junk-laden responses ({statuses}); the other user's stored response is still there")


async def huge_user(t: Target, http: httpx.AsyncClient) -> Outcome:
    """A 1 MB `user`: refused, and /health stays small."""
    r = await http.post(t.url + "/v1/completions", headers=t.headers, timeout=60,
                        json={"prompt": "hi", "max_tokens": 1, "user": "u" * 2**20})
    health = await http.get(t.url + "/health", headers=t.headers)
    if r.status_code != 400:
        return broke(f"a 1 MB user got {r.status_code}")
    if len(health.content) > 256 * 1024:
        return broke(f"/health is {len(health.content) / 1024:.0f} KiB")
    return held(f"400 ({_error_message(r)[:80]}); /health {len(health.content) / 1024:.0f} KiB")


async def infinite_knob(t: Target, http: httpx.AsyncClient) -> Outcome:
    """`max_step_ms` set to 1e999 (JSON for infinity): refused, and nothing changes."""
    before = await http.get(t.url + "/knobs", headers=t.headers)
    r = await http.post(t.url + "/knobs", headers={**t.headers, "content-type": "application/json"},
                        content=b'{"max_step_ms": 1e999}')
    after = await http.get(t.url + "/knobs", headers=t.headers)
    health = await http.get(t.url + "/health", headers=t.headers)
    if r.status_code != 400:
        return broke(f"POST /knobs max_step_ms=1e999 got {r.status_code}")
    if after.status_code != 200 or _knob_values(before) != _knob_values(after):
        return broke("the refused change changed the knobs")
    if health.status_code != 200:
        return broke(f"/health answers {health.status_code} after it")
    return held(f"400 ({_error_message(r)[:80]}); knobs unchanged")


def _knob_values(r: httpx.Response) -> dict:
    body = r.json()
    return body.get("knobs", body) if isinstance(body, dict) else body


async def template_bomb(t: Target, http: httpx.AsyncClient) -> Outcome:
    """A request's chat template that builds a 20 MB string, or includes another: a prompt 400."""
    if not t.trusts_templates:
        return skipped("the server does not take request templates (--trust-request-chat-template)")
    said = []
    for template in ("{{ 'a' * 20000000 }}", "{% include 'other.jinja' %}", "{% for i in range(100001) %}{% endfor %}"):
        started = time.monotonic()
        r = await http.post(t.url + "/v1/chat/completions", headers=t.headers, timeout=120,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                  "chat_template": template})
        seconds = time.monotonic() - started
        if r.status_code != 400 or seconds > 10 or not _no_internals(r.text):
            return broke(f"template {template!r}: {r.status_code} after {seconds:.1f} s: {r.text[:160]}")
        said.append(f"{seconds:.2f} s")
    return held(f"three templates refused with 400 in {', '.join(said)}")


async def malformed_text(t: Target, http: httpx.AsyncClient) -> Outcome:
    """A lone surrogate in a prompt and a message, and a guided_choice of 100,000 entries: 400s naming the
    problem, with no traceback or panic in them."""
    checks = [
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 1}'),
        ("/tokenize", b'{"prompt": "\\udfff"}'),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1,
                                         "guided_choice": [f"c{i}" for i in range(100_000)]}).encode()),
    ]
    said = []
    for route, raw in checks:
        started = time.monotonic()
        r = await http.post(t.url + route, headers={**t.headers, "content-type": "application/json"},
                            content=raw, timeout=120)
        seconds = time.monotonic() - started
        if r.status_code != 400 or seconds > 10 or not _no_internals(r.text) or len(r.content) > 4096:
            return broke(f"{route} {raw[:60]!r}: {r.status_code} after {seconds:.1f} s: {r.text[:200]}")
        said.append(f"{route} 400")
    return held("; ".join(said))


async def bad_handshakes(t: Target, http: httpx.AsyncClient) -> Outcome:
    """Strangers at the replicas' listener (garbage, a wrong key, a connection that says nothing): a killed
    replica still rejoins."""
    host = getattr(t.server, "host", None)
    launcher = getattr(host, "launcher", None)
    if launcher is None or not hasattr(host, "address"):
        return skipped("no data-parallel replicas (--data-parallel-size 2)")
    listen_host, listen_port = host.address
    silent = []
    for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 4096, b""):
        reader, writer = await asyncio.open_connection(listen_host, listen_port)
        if payload:
            writer.write(payload)
            await writer.drain()
        silent.append(writer)
    ready_before = _ready_replicas(host)
    await asyncio.to_thread(launcher.kill, 0)
    rejoined = await _wait_for(lambda: _ready_replicas(host) == ready_before, 240)
    for writer in silent:
        writer.close()
    if not rejoined:
        return broke(f"a killed replica did not rejoin in 240 s with strangers at the listener: "
                     f"{[link.status for link in host.links]}")
    return held("four strangers at the listener; a killed replica rejoined")


def _ready_replicas(host) -> int:
    return sum(link.status == "ready" for link in host.links)


async def _wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.5)
    return predicate()


Attack = Callable[[Target, httpx.AsyncClient], Awaitable[Outcome]]

# (name, what it exercises, the attack); `bench hostile` runs them in this order
ATTACKS: list[tuple[str, str, Attack]] = [
    ("stalled uploads to the open /health", "body deadline, bodies read after the key", slow_bodies),
    ("a grammar that fails while generating", "fault containment per request", failing_grammar),
    ("800 messages in a custom role", "chat rendering linear in the conversation", long_chat),
    ("conversations abandoned mid-render", "renderings of departed callers", abandoned_chats),
    ("stored responses with 1 MB junk", "response store bounds, per user", response_flood),
    ("a 1 MB user", "bounded free strings", huge_user),
    ("a knob set to infinity", "live knobs checked as flags", infinite_knob),
    ("request templates that explode", "template time and size budget", template_bomb),
    ("lone surrogates, 100,000 choices", "malformed text, no internals echoed", malformed_text),
    ("strangers at the replicas' listener", "data-parallel handshakes", bad_handshakes),
]


async def run_one(attack: Attack, target: Target, http: httpx.AsyncClient) -> Outcome:
    """One attack, timed; an exception it meets (the server hung up, a timeout) is the server not holding."""
    started = time.monotonic()
    try:
        outcome = await attack(target, http)
    except Disrupted as e:
        outcome = skipped(f"the benchmark's own disruption reached it ({e})")
    except (httpx.HTTPError, OSError, asyncio.TimeoutError) as e:
        outcome = broke(f"{type(e).__name__}: {e}")
    outcome.seconds = time.monotonic() - started
    return outcome
