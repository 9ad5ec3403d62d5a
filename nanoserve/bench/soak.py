"""`nanoserve bench soak`: minutes of mixed, hostile traffic against a live server on loopback, and an account
of every request.

Clients send streamed and non-streamed completions and chats, greedy and sampled; some disconnect mid-stream,
some abandon a non-streamed call before its answer, some send hostile bodies; one reads a long stream slowly;
the engine is restarted with new flags half-way; one forward in 500 fails on purpose (--fault-every; 0 for none)
to prove a failure ends only its own requests. /health is polled throughout. The table says what every client received,
and what the server still holds at the end: blocks (must be 0), live requests (0), requests the host admitted
but never answered (0), 5xx outside the injected faults (0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.hostile import chunked_oversize, hostile_bodies
from nanoserve.bench.memory import resident_mib, trimmed_resident_mib
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.stats import percentiles
from nanoserve.workload import SAMPLED, pick_prompts

FAULT_EVERY = 500  # a few faults a minute on the default model: each ends its step's requests, and no others


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="mixed, hostile traffic with disconnects and a restart; account for every request")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic (default 120)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="the most tokens a request asks for")
    p.add_argument("--restart-flags", default="max_num_seqs=6",
                   help="flags the mid-run restart applies, as name=value pairs ('' for no restart)")
    p.add_argument("--fault-every", type=int, default=FAULT_EVERY,
                   help=f"fail one engine forward in N on purpose (default {FAULT_EVERY}; 0: none); their requests "
                        "must end with an error and no other request may")
    p.add_argument("--traffic-seed", type=int, default=0, help="seeds the traffic mix (the engine has --seed)")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


@dataclass
class Tally:
    """What the clients received, by outcome; `broken` is anything no correct server sends."""

    outcomes: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    health_latency: list[float] = field(default_factory=list)
    health_failures: int = 0

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def bad(self, what: str) -> None:
        self.outcomes["broken"] += 1
        if len(self.broken) < 20:
            self.broken.append(what)


class FaultInjector:
    """Wraps the engine's forward: every Nth call raises, as a kernel fault would (0: never)."""

    def __init__(self, every: int):
        self.every, self.calls, self.injected = every, 0, 0

    def install(self, engine) -> None:
        if not self.every:
            return
        real = engine.runner.model.forward

        def forward(*args, **kwargs):
            self.calls += 1
            if self.calls % self.every == 0:
                self.injected += 1
                raise RuntimeError("injected fault (bench soak --fault-every)")
            return real(*args, **kwargs)

        engine.runner.model.forward = forward


def _error_kind(status: int, raw: bytes) -> str | None:
    """The OpenAI error's message, or None when the body is not OpenAI's error shape."""
    try:
        error = json.loads(raw)["error"]
        return error["message"] if {"message", "type"} <= set(error) else None
    except (ValueError, KeyError, TypeError):
        return None


class Soak:
    def __init__(self, url: str, max_model_len: int, args, tally: Tally):
        self.url, self.args, self.tally = url, args, tally
        self.rng = random.Random(args.traffic_seed)
        self.prompts = pick_prompts(16)
        self.hostile = hostile_bodies(max_model_len)
        self.serial = 0

    def body(self, rng: random.Random) -> dict:
        self.serial += 1
        chat = rng.random() < 0.5
        prompt = rng.choice(self.prompts)
        body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body.update(max_tokens=rng.randint(1, self.args.max_tokens), stream=rng.random() < 0.6)
        if rng.random() < 0.5:
            body.update(SAMPLED, seed=self.serial)
        else:
            body["temperature"] = 0
        if rng.random() < 0.2:
            body["n"] = 2
        return body

    async def one(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.1:
            return await self.hostile_request(http, rng)
        body = self.body(rng)
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if body["stream"]:
            leave_after = rng.randint(1, 6) if roll < 0.25 else None
            return await self.streamed(http, route, body, leave_after)
        abandon_after = rng.uniform(0.02, 0.5) if roll < 0.2 else None
        return await self.whole(http, route, body, abandon_after)

    async def streamed(self, http, route: str, body: dict, leave_after: int | None) -> None:
        events, finish = 0, []
        async with http.stream("POST", self.url + route, json=body) as r:
            if r.status_code != 200:
                return self.refused(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return self.stream_ended(finish, events)
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    finish.append("error:" + event["error"]["message"])
                    continue
                events += 1
                finish += [c["finish_reason"] for c in event.get("choices", ()) if c.get("finish_reason")]
                if leave_after is not None and events >= leave_after:
                    return self.tally.add("disconnected mid-stream")
        if leave_after is None:
            self.tally.bad(f"a stream ended without [DONE] after {events} events")
        else:
            self.tally.add("disconnected mid-stream")

    def stream_ended(self, finish: list[str], events: int) -> None:
        errors = [f for f in finish if f.startswith("error:")]
        if errors:
            return self.tally.add("stream: error event (injected fault)" if "injected fault" in errors[0]
                                  else "stream: error event (not injected)")
        if not finish:
            return self.tally.bad(f"a stream reached [DONE] with no finish_reason after {events} events")
        self.tally.add(f"stream finished: {'abort' if 'abort' in finish else 'stop/length'}")

    async def whole(self, http, route: str, body: dict, abandon_after: float | None) -> None:
        call = http.post(self.url + route, json=body)
        if abandon_after is not None:
            try:
                r = await asyncio.wait_for(call, abandon_after)
            except asyncio.TimeoutError:
                return self.tally.add("abandoned before the answer")
        else:
            r = await call
        if r.status_code != 200:
            return self.refused(r.status_code, r.content)
        reasons = {c["finish_reason"] for c in r.json()["choices"]}
        if None in reasons:
            return self.tally.bad(f"a 200 answer with an unfinished choice: {r.text[:200]}")
        self.tally.add(f"answer: {'abort' if 'abort' in reasons else 'stop/length'}")

    def refused(self, status: int, raw: bytes) -> None:
        message = _error_kind(status, raw)
        if message is None:
            return self.tally.bad(f"HTTP {status} without an OpenAI error body: {raw[:200]!r}")
        if status >= 500 and status != 503:
            kind = "injected fault" if "injected fault" in message else "NOT injected"
            return self.tally.add(f"{status} ({kind})")
        self.tally.add(f"refused {status}")

    async def hostile_request(self, http, rng: random.Random) -> None:
        name, route, content, headers, expected = rng.choice(self.hostile)
        data = chunked_oversize() if content is None else content
        try:
            r = await http.post(self.url + route, content=data, headers=headers)
        except httpx.RemoteProtocolError:  # the server closed a chunked upload after its 413
            if content is None:
                return self.tally.add("hostile: refused (connection closed mid-upload)")
            raise
        message = _error_kind(r.status_code, r.content)
        if r.status_code == 503 and message is not None:
            return self.tally.add("refused 503")  # during the restart, every request is
        if r.status_code != expected or message is None:
            return self.tally.bad(f"hostile body {name!r}: HTTP {r.status_code} (expected {expected}): "
                                  f"{r.text[:160]}")
        self.tally.add("hostile: refused as expected")

    async def slow_reader(self, http, stop: asyncio.Event) -> None:
        """One long stream read a chunk every 0.3 s while the server runs ahead."""
        body = {"prompt": "Tell me a long story.", "max_tokens": 4 * self.args.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        while not stop.is_set():
            try:
                async with http.stream("POST", self.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.refused(r.status_code, await r.aread())
                        await asyncio.sleep(0.2)
                        continue
                    finish = []
                    async for line in r.aiter_lines():
                        if stop.is_set():
                            self.tally.add("disconnected mid-stream")
                            break
                        if line == "data: [DONE]":
                            self.stream_ended(finish, 1)
                            break
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                finish.append("error:" + event["error"]["message"])
                            finish += [c["finish_reason"] for c in event.get("choices", ()) if c.get("finish_reason")]
                            await asyncio.sleep(0.3)
                    else:
                        self.tally.bad("the slow reader's stream ended without [DONE]")
            except httpx.HTTPError as e:
                self.tally.bad(f"slow reader: {e!r}")

    async def health(self, http, stop: asyncio.Event) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                r = await http.get(self.url + "/health")
                self.tally.health_latency.append(time.perf_counter() - start)
                if r.status_code not in (200, 503):
                    self.tally.health_failures += 1
            except httpx.HTTPError:
                self.tally.health_failures += 1
            await asyncio.sleep(0.2)

    async def client(self, http, seed: int, stop: asyncio.Event) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            state = rng.getstate()
            try:
                await self.one(http, rng)
            except httpx.HTTPError as e:
                rng.setstate(state)  # replay the choice to say which request it was
                self.tally.bad(f"transport error {e!r} on {self.describe(rng)}")

    def describe(self, rng: random.Random) -> str:
        roll = rng.random()
        if roll < 0.1:
            return f"hostile body {rng.choice(self.hostile)[0]!r}"
        return json.dumps(self.body(rng))[:200]

    async def run(self, duration: float, restart) -> float:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=self.args.clients + 8)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            tasks = [asyncio.create_task(self.client(http, self.args.traffic_seed * 1000 + i, stop))
                     for i in range(self.args.clients)]
            tasks += [asyncio.create_task(self.slow_reader(http, stop)), asyncio.create_task(self.health(http, stop))]
            started = time.monotonic()
            await asyncio.sleep(duration / 2)
            if restart is not None:
                await asyncio.to_thread(restart)
            await asyncio.sleep(max(0.0, duration - (time.monotonic() - started)))
            stop.set()
            await asyncio.gather(*tasks)
            return time.monotonic() - started


def soak(config, args) -> dict:
    """Serve `config` in this process, run the traffic, and return the account (see the module docstring)."""
    from nanoserve.ab import variant
    from nanoserve.server.serve import Server

    server = Server(config, port=0, served_model_name=None).start()
    faults = FaultInjector(args.fault_every)
    faults.install(server.host.engine)
    tally = Tally()
    restarted = {}

    def restart() -> None:
        new = variant(server.host.engine.config, args.restart_flags.replace(",", " "))
        started = time.monotonic()
        server.host.restart(new)
        faults.install(server.host.engine)
        restarted["seconds"] = time.monotonic() - started

    try:
        rss_start = trimmed_resident_mib()
        runner = Soak(server.url, server.host.engine.max_model_len, args, tally)
        duration = asyncio.run(runner.run(args.duration, restart if args.restart_flags else None))
        settle = time.monotonic() + 30
        while server.host.live_requests() and time.monotonic() < settle:
            time.sleep(0.05)
        time.sleep(0.2)
        kv = server.host.stats().kv
        account = server.host.accounting()
        engine = server.host.engine
        queue = engine.scheduler_stats()
        leftovers = {**engine.output_processor.leftovers(), "running": queue.running, "waiting": queue.waiting}
        rss_end = resident_mib()
        rss_trimmed = trimmed_resident_mib()
    finally:
        server.stop()
    sent = sum(tally.outcomes.values())
    five_xx = sum(n for k, n in tally.outcomes.items() if k.startswith("5") and "NOT injected" in k) + \
        tally.outcomes.get("stream: error event (not injected)", 0)
    return {
        "duration_s": duration, "requests_sent": sent, "outcomes": dict(sorted(tally.outcomes.items())),
        "broken": tally.broken, "five_xx_not_injected": five_xx, "fault_every": args.fault_every,
        "faults_injected": faults.injected,
        "blocks_held_at_end": kv.blocks_total - kv.blocks_free, "host": account,
        "unanswered": account["admitted"] - account["ended"] - account["live"] - account["dropped"],
        "restart_s": restarted.get("seconds"), "rss_mib_start": rss_start, "rss_mib_end": rss_end,
        "rss_mib_end_trimmed": rss_trimmed, "engine_leftovers": leftovers,
        "health_polls": len(tally.health_latency), "health_failures": tally.health_failures,
        "health_p50_ms": 1000 * percentiles(tally.health_latency, 0.5)[0] if tally.health_latency else None,
        "health_p99_ms": 1000 * percentiles(tally.health_latency, 0.99)[0] if tally.health_latency else None,
    }


def clean(result: dict) -> list[str]:
    """What a soak must not show; empty when the run was clean."""
    problems = []
    if result["broken"] or result["outcomes"].get("broken"):
        problems.append(f"{result['outcomes'].get('broken', 0)} broken responses: {result['broken'][:3]}")
    for key in ("five_xx_not_injected", "blocks_held_at_end", "unanswered", "health_failures"):
        if result[key]:
            problems.append(f"{key} = {result[key]}")
    if any(result["engine_leftovers"].values()):
        problems.append(f"the engine still holds {result['engine_leftovers']}")
    if result["host"]["live"] or result["host"]["dropped"]:
        problems.append(f"host: {result['host']}")
    if result["fault_every"] and not result["faults_injected"]:
        problems.append(f"no fault was injected in {result['duration_s']:.0f} s (one forward in "
                        f"{result['fault_every']} fails): the run proves nothing about faults; run it longer "
                        "(--duration) or fail more often (a smaller --fault-every)")
    return problems


def main(args) -> int:
    from nanoserve.config import EngineConfig

    config = EngineConfig.from_flags(**engine_flags(args))
    result = soak(config, args)
    rows = [{"outcome": k, "requests": n} for k, n in result["outcomes"].items()]
    print_table(f"bench soak: {result['requests_sent']} requests in {result['duration_s']:.0f} s, "
                f"{args.clients} clients, restart to {args.restart_flags or 'none'}, "
                f"{result['faults_injected']} faults injected", rows, ["outcome", "requests"])
    summary = [
        {"measure": "5xx not injected (must be 0)", "value": result["five_xx_not_injected"]},
        {"measure": "blocks held at the end (must be 0)", "value": result["blocks_held_at_end"]},
        {"measure": "requests admitted / ended / live / dropped",
         "value": "{admitted} / {ended} / {live} / {dropped}".format(**result["host"])},
        {"measure": "requests unanswered (must be 0)", "value": result["unanswered"]},
        {"measure": "broken responses (must be 0)", "value": result["outcomes"].get("broken", 0)},
        {"measure": "engine restart (s)", "value": result["restart_s"]},
        {"measure": "resident memory start / end / end trimmed (MiB)",
         "value": f"{result['rss_mib_start']:,.0f} / {result['rss_mib_end']:,.0f} / "
                  f"{result['rss_mib_end_trimmed']:,.0f}"},
        {"measure": "engine requests left (groups, streams, rows)", "value": "{groups}, {streams}, {running}+{waiting}"
         .format(**result["engine_leftovers"])},
        {"measure": "/health polls, p50 / p99 (ms)",
         "value": f"{result['health_polls']}, {result['health_p50_ms']:.1f} / {result['health_p99_ms']:.1f}"},
    ]
    print_table("account", summary, ["measure", "value"])
    for line in result["broken"]:
        print("  broken:", line)
    path = write_results(args.out, "soak", {**result, "summary": summary}, rows, args)
    print(f"\nwrote {path}")
    problems = clean(result)
    for p in problems:
        print("NOT CLEAN:", p)
    return 1 if problems else 0
