"""`nanoserve bench hostile`: every attack of nanoserve/bench/attacks.py against a live server, in turn, beside
normal traffic, and a table of what held.

Also the request bodies a careless or hostile client sends (`hostile_bodies`): each must be refused with a 4xx
and an OpenAI error body, hold nothing, and leave the server serving. The soak mixes both into its traffic; the
fuzz tests generate many more bodies.

The server runs in this process with an API key and --trust-request-chat-template (so the template attacks
apply), and with --data-parallel-size N its replicas are attacked at their listener too. Beside the attacks two
clients send plain requests the whole time: none of theirs may fail. At the end no KV block may be held.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter

import httpx

from nanoserve.bench.attacks import ATTACKS, Target, attack_client, on_purpose, run_one
from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.memory import resident_mib
from nanoserve.flags import add_data_parallel_flags, add_engine_flags, engine_flags

LIMIT_BYTES = 4 * 2**20  # the server's default body limit


def _json(text: str) -> tuple[bytes, dict]:
    return text.encode(), {"content-type": "application/json"}


def hostile_bodies(max_model_len: int) -> list[tuple[str, str, bytes | None, dict, int]]:
    """(name, route, body bytes or None for a chunked oversized one, headers, status expected)."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("not JSON", completions, *_json("{prompt: hi"), 400),
        ("NaN temperature", completions, *_json('{"prompt": "hi", "temperature": NaN}'), 400),
        ("negative max_tokens", completions, *_json('{"prompt": "hi", "max_tokens": -5}'), 400),
        ("prompt of the wrong type", completions, *_json('{"prompt": {"a": 1}}'), 400),
        ("token id outside the vocabulary", completions, *_json('{"prompt": [99999999], "max_tokens": 1}'), 400),
        ("prompt longer than max_model_len", completions,
         *_json(f'{{"prompt": [1], "max_tokens": {max_model_len + 10}}}'), 400),
        ("unknown model", completions, *_json('{"model": "gpt-9", "prompt": "hi"}'), 404),
        ("no messages", chat, *_json('{"messages": []}'), 400),
        ("a role that is no string", chat, *_json('{"messages": [{"role": 5, "content": "hi"}]}'), 400),
        ("tools, which are refused", chat,
         *_json('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}'), 400),
        ("deeply nested JSON", completions, *_json('{"prompt": ' + "[" * 2000 + "]" * 2000 + "}"), 400),
        ("bytes that are not UTF-8", completions, b'{"prompt": "\xff\xfe"}', {"content-type": "application/json"},
         400),
        ("a body over the limit, declared", completions, b"x" * (LIMIT_BYTES + 1),
         {"content-type": "application/json"}, 413),
        ("a body over the limit, chunked", completions, None, {"content-type": "application/json"}, 413),
    ]


async def chunked_oversize():
    """An oversized body with no Content-Length (an async client sends it chunked): the server must count it
    as it arrives."""
    yield b'{"prompt": "'
    piece = b"word " * 13107  # 64 KiB
    for _ in range(LIMIT_BYTES // len(piece) + 2):
        yield piece
    yield b'"}'


def add_parser(sub) -> None:
    p = sub.add_parser("hostile", help="every hostile caller's attack against a live server; a table of what held")
    p.add_argument("--only", nargs="*", default=None, metavar="WORD",
                   help="run only the attacks whose name contains one of these words")
    p.add_argument("--out", default="bench-results")
    add_data_parallel_flags(p)
    add_engine_flags(p)


async def _plain_traffic(url: str, headers: dict, stop: asyncio.Event, tally: dict) -> None:
    """A caller who did nothing wrong: short greedy completions, one after another."""
    async with httpx.AsyncClient(timeout=120, headers=headers) as http:
        while not stop.is_set():
            try:
                r = await http.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                                   "temperature": 0})
                tally[_plain_outcome(r)] += 1
            except httpx.HTTPError as e:
                tally[type(e).__name__] += 1


def _plain_outcome(r: httpx.Response) -> str:
    """"ok", "killed replica" (the listener attack kills one: its requests end with an error on purpose), or the
    failure's status."""
    if r.status_code == 200:
        return "ok"
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    return on_purpose(message) or f"HTTP {r.status_code}"


async def _attack_all(target: Target, chosen: list) -> tuple[list[dict], dict]:
    stop, tally = asyncio.Event(), Counter(ok=0)
    plain = [asyncio.create_task(_plain_traffic(target.url, target.headers, stop, tally)) for _ in range(2)]
    rows = []
    async with attack_client(timeout=120) as http:
        for name, exercises, attack in chosen:
            outcome = await run_one(attack, target, http)
            verdict = {True: "held", False: "BROKE", None: "skipped"}[outcome.held]
            rows.append({"attack": name, "exercises": exercises, "verdict": verdict,
                         "seconds": round(outcome.seconds, 2), "said": outcome.said})
            print(f"  {verdict:7} {name}: {outcome.said}", flush=True)
    stop.set()
    await asyncio.gather(*plain)
    return rows, dict(tally)


def _settled_blocks(server, headers: dict, seconds: float = 30.0) -> int | None:
    """KV blocks still held once nothing runs (0 when every attack let go of what it took); None when /health never
    answered with the KV section (an attack broke it)."""
    deadline = time.monotonic() + seconds
    held = None
    while True:
        kv = _health(server, headers)[1].get("kv")
        if kv:
            held = kv["blocks_total"] - kv["blocks_free"]
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _health(server, headers: dict) -> tuple[int, dict]:
    """/health's status code and body ({} when it is not JSON)."""
    try:
        r = httpx.get(server.url + "/health", headers=headers, timeout=30)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        return 0, {"status": type(e).__name__}


def main(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.server.serve import DataParallel, Server

    config = EngineConfig.from_flags(**engine_flags(args))
    key = secrets.token_urlsafe(16)
    data_parallel = DataParallel(args.data_parallel_size, args.data_parallel_backend, args.ray_address,
                                 args.data_parallel_routing) if args.data_parallel_size > 1 else None
    chosen = [a for a in ATTACKS if not args.only or any(w.lower() in a[0].lower() for w in args.only)]
    server = Server(config, port=0, api_key=key, trust_request_chat_template=True, served_model_name=None,
                    data_parallel=data_parallel).start()
    try:
        target = Target(server.url, key, server, trusts_templates=True)
        rss_start = resident_mib()
        rows, plain = asyncio.run(_attack_all(target, chosen))
        blocks = _settled_blocks(server, target.headers)
        health = _health(server, target.headers)
        rss_end = resident_mib()
    finally:
        server.stop()
    print_table(f"bench hostile: {len(rows)} attacks, data-parallel size {args.data_parallel_size}", rows,
                ["attack", "verdict", "seconds", "exercises"])
    failed_plain = sum(n for k, n in plain.items() if k not in ("ok", "killed replica"))
    summary = [
        {"measure": "attacks held / broke / skipped",
         "value": " / ".join(str(sum(r["verdict"] == v for r in rows)) for v in ("held", "BROKE", "skipped"))},
        {"measure": "plain requests beside them: answered / failed (must be 0)",
         "value": f"{plain.get('ok', 0)} / {failed_plain}" + (f" ({plain['killed replica']} on the killed replica)"
                                                              if plain.get("killed replica") else "")},
        {"measure": "KV blocks held at the end (must be 0)", "value": blocks},
        {"measure": "/health at the end", "value": f"{health[0]} {health[1].get('status')}"},
        {"measure": "resident memory start / end (MiB)", "value": f"{rss_start:,.0f} / {rss_end:,.0f}"},
    ]
    print_table("account", summary, ["measure", "value"])
    path = write_results(args.out, "hostile", {"attacks": rows, "plain": plain, "summary": summary}, rows, args)
    print(f"\nwrote {path}")
    broken = [r for r in rows if r["verdict"] == "BROKE"]
    return 1 if broken or failed_plain or blocks != 0 or health[0] != 200 else 0
