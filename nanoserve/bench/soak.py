"""`nanoserve bench soak`: minutes of mixed, hostile traffic against a live server on loopback, and an account
of every request.

Clients send streamed and non-streamed completions and chats, greedy and sampled; some disconnect mid-stream,
some abandon a non-streamed call before its answer, some send hostile bodies; one reads a long stream slowly;
one hostile caller runs every attack of bench/attacks.py in turn, and each must hold. One engine is restarted
with new flags half-way and one forward in 500 fails on purpose (--fault-every; 0 for none) to prove a failure
ends only its own requests; under --data-parallel-size N a replica is killed every --kill-every seconds instead.
The open /health is polled throughout, and the server's resident memory sampled. The table says what every
client received, and what the server still holds at the end: blocks (must be 0), live requests (0), requests
the host admitted but never answered (0), 5xx outside the injected faults and killed replicas (0), and memory
within 10% of what it held after the first minute.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from nanoserve.bench.attacks import ATTACKS, attack_client, on_purpose, run_one
from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.hostile import chunked_oversize, hostile_bodies
from nanoserve.bench.soak_server import SoakServer
from nanoserve.flags import add_data_parallel_flags, add_engine_flags, engine_flags
from nanoserve.stats import percentiles
from nanoserve.workload import SAMPLED, pick_prompts

FAULT_EVERY = 500  # a few faults a minute on the default model: each ends its step's requests, and no others
KILL_EVERY_S = 240.0  # data parallel: a replica killed this often (a rejoin takes a few seconds to a minute)
RSS_SETTLED_S = 60.0  # memory is held to its value this far in (the first minute warms caches and pools)
RSS_GROWTH = 0.10  # the most resident memory may grow past that value by the end
RETRY_AFTER_503_S = 0.25  # a client refused with 503 (the engine restarting, no replica ready) waits this long
ATTACK_PAUSE_S = 2.0  # between two attacks of the hostile caller


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
    p.add_argument("--kill-every", type=float, default=KILL_EVERY_S,
                   help=f"with --data-parallel-size: SIGKILL a replica every S seconds, in turn (default "
                        f"{KILL_EVERY_S:.0f}; 0: none); its requests must end with an error and it must rejoin")
    p.add_argument("--no-attacks", action="store_true", help="leave out the hostile caller's attacks")
    p.add_argument("--traffic-seed", type=int, default=0, help="seeds the traffic mix (the engine has --seed)")
    p.add_argument("--out", default="bench-results")
    add_data_parallel_flags(p)
    add_engine_flags(p)


@dataclass
class Tally:
    """What the clients received, by outcome; `broken` is anything no correct server sends."""

    outcomes: Counter = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    health_latency: list[float] = field(default_factory=list)
    health_failures: int = 0
    attacks: list[dict] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the run, MiB)

    def add(self, outcome: str) -> str:
        """Count `outcome`, and return it (a client's request says what became of it)."""
        self.outcomes[outcome] += 1
        return outcome

    def bad(self, what: str) -> None:
        self.outcomes["broken"] += 1
        if len(self.broken) < 20:
            self.broken.append(what)


def _error_kind(status: int, raw: bytes) -> str | None:
    """The OpenAI error's message, or None when the body is not OpenAI's error shape."""
    try:
        error = json.loads(raw)["error"]
        return error["message"] if {"message", "type"} <= set(error) else None
    except (ValueError, KeyError, TypeError):
        return None


class Soak:
    def __init__(self, server: SoakServer, args, tally: Tally):
        self.server, self.url, self.args, self.tally = server, server.url, args, tally
        max_model_len = server.max_model_len
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

    async def one(self, http: httpx.AsyncClient, rng: random.Random) -> str | None:
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

    async def streamed(self, http, route: str, body: dict, leave_after: int | None) -> str | None:
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

    def stream_ended(self, finish: list[str], events: int) -> str | None:
        errors = [f for f in finish if f.startswith("error:")]
        if errors:
            cause = on_purpose(errors[0])
            return self.tally.add(f"stream: error event ({cause or 'not on purpose'})")
        if not finish:
            return self.tally.bad(f"a stream reached [DONE] with no finish_reason after {events} events")
        self.tally.add(f"stream finished: {'abort' if 'abort' in finish else 'stop/length'}")

    async def whole(self, http, route: str, body: dict, abandon_after: float | None) -> str | None:
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

    def refused(self, status: int, raw: bytes) -> str | None:
        message = _error_kind(status, raw)
        if message is None:
            return self.tally.bad(f"HTTP {status} without an OpenAI error body: {raw[:200]!r}")
        if status >= 500 and status != 503:
            return self.tally.add(f"{status} ({on_purpose(message) or 'NOT on purpose'})")
        return self.tally.add(f"refused {status}")

    async def hostile_request(self, http, rng: random.Random) -> str | None:
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

    async def health(self, stop: asyncio.Event) -> None:
        """The open /health (no key), as a load balancer's probe reads it."""
        async with httpx.AsyncClient(timeout=30) as http:
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

    async def attacker(self, stop: asyncio.Event) -> None:
        """The hostile caller: every attack in turn, again and again; each must hold."""
        target = self.server.target()
        async with attack_client(timeout=120) as http:
            while not stop.is_set():
                for name, _, attack in ATTACKS:
                    if stop.is_set():
                        return
                    outcome = await run_one(attack, target, http)
                    if outcome.held is False:
                        self.tally.bad(f"attack {name!r} broke the server: {outcome.said[:200]}")
                    elif outcome.held:
                        self.tally.add("attack held")
                    self.tally.attacks.append({"attack": name, "held": outcome.held,
                                               "seconds": round(outcome.seconds, 2), "said": outcome.said[:300]})
                    await asyncio.sleep(ATTACK_PAUSE_S)

    async def memory(self, stop: asyncio.Event, every: float) -> None:
        started = time.monotonic()
        while True:
            mib = await asyncio.to_thread(self.server.resident_mib)
            if mib is not None:
                self.tally.rss.append((time.monotonic() - started, mib))
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except asyncio.TimeoutError:
                pass

    async def disruptions(self, duration: float, stop: asyncio.Event) -> None:
        """One engine: the restart half-way. Data parallel: a replica killed every --kill-every seconds."""
        if not self.server.parallel:
            if self.args.restart_flags:
                await asyncio.sleep(duration / 2)
                await asyncio.to_thread(self.server.restart)
            return
        every = self.args.kill_every
        while every and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except asyncio.TimeoutError:
                await asyncio.to_thread(self.server.kill_replica)

    async def client(self, http, seed: int, stop: asyncio.Event) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            state = rng.getstate()
            outcome = None
            try:
                outcome = await self.one(http, rng)
            except httpx.HTTPError as e:
                rng.setstate(state)  # replay the choice to say which request it was
                self.tally.bad(f"transport error {e!r} on {self.describe(rng)}")
            if outcome == "refused 503":
                await asyncio.sleep(RETRY_AFTER_503_S)  # as a client told to retry later would

    def describe(self, rng: random.Random) -> str:
        roll = rng.random()
        if roll < 0.1:
            return f"hostile body {rng.choice(self.hostile)[0]!r}"
        return json.dumps(self.body(rng))[:200]

    async def run(self, duration: float) -> float:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=self.args.clients + 8)
        async with httpx.AsyncClient(timeout=30, limits=limits, headers=self.server.target().headers) as http:
            tasks = [asyncio.create_task(self.client(http, self.args.traffic_seed * 1000 + i, stop))
                     for i in range(self.args.clients)]
            tasks += [asyncio.create_task(self.slow_reader(http, stop)), asyncio.create_task(self.health(stop)),
                      asyncio.create_task(self.memory(stop, min(RSS_SETTLED_S, duration / 6)))]
            if not self.args.no_attacks:
                tasks.append(asyncio.create_task(self.attacker(stop)))
            started = time.monotonic()
            disruptions = asyncio.create_task(self.disruptions(duration, stop))
            await asyncio.sleep(duration)
            stop.set()
            await asyncio.gather(*tasks, disruptions)
            return time.monotonic() - started


def soak(config, args) -> dict:
    """Serve `config` in this process (or its replicas), run the traffic, and return the account (see the module
    docstring)."""
    server = SoakServer(config, args)
    tally = Tally()
    try:
        runner = Soak(server, args, tally)
        duration = asyncio.run(runner.run(args.duration))
        server.settle()
        account = server.account()
        rss_end = server.resident_mib()
    finally:
        server.stop()
    sent = sum(tally.outcomes.values())
    five_xx = sum(n for k, n in tally.outcomes.items() if k.startswith("5") and "NOT on purpose" in k) + \
        tally.outcomes.get("stream: error event (not on purpose)", 0)
    return {
        "duration_s": duration, "requests_sent": sent, "outcomes": dict(sorted(tally.outcomes.items())),
        "broken": tally.broken, "five_xx_not_on_purpose": five_xx, "fault_every": server.faults.every,
        "faults_injected": server.faults.injected, "replicas_killed": server.kills, **account,
        "unanswered": account["host"]["admitted"] - account["host"]["ended"] - account["host"]["live"]
        - account["host"]["dropped"],
        "restart_s": server.restart_s, "rss_mib": tally.rss + ([(duration, rss_end)] if rss_end is not None else []),
        "attacks": tally.attacks, "data_parallel_size": args.data_parallel_size,
        "health_polls": len(tally.health_latency), "health_failures": tally.health_failures,
        "health_p50_ms": 1000 * percentiles(tally.health_latency, 0.5)[0] if tally.health_latency else None,
        "health_p99_ms": 1000 * percentiles(tally.health_latency, 0.99)[0] if tally.health_latency else None,
    }


def rss_settled(samples: list[tuple[float, float]], duration: float) -> float:
    """Resident memory once warm: the first sample at least a minute in (a third of the way in on a shorter run)."""
    settled_at = min(RSS_SETTLED_S, duration / 3)
    return next((mib for t, mib in samples if t >= settled_at), samples[-1][1])


def clean(result: dict) -> list[str]:
    """What a soak must not show; empty when the run was clean."""
    problems = []
    if result["broken"] or result["outcomes"].get("broken"):
        problems.append(f"{result['outcomes'].get('broken', 0)} broken responses: {result['broken'][:3]}")
    for key in ("five_xx_not_on_purpose", "blocks_held_at_end", "unanswered", "health_failures"):
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
    if result["replicas_ready"] is not None and result["replicas_ready"] < result["data_parallel_size"]:
        problems.append(f"only {result['replicas_ready']} of {result['data_parallel_size']} replicas ready at the end")
    settled, end = rss_settled(result["rss_mib"], result["duration_s"]), result["rss_mib"][-1][1]
    if end > settled * (1 + RSS_GROWTH):
        problems.append(f"resident memory grew from {settled:,.0f} MiB (warm) to {end:,.0f} MiB at the end, past "
                        f"{RSS_GROWTH:.0%}")
    return problems


def _summary(result: dict, args) -> list[dict]:
    leftovers = result["engine_leftovers"]
    settled = rss_settled(result["rss_mib"], result["duration_s"])
    return [
        {"measure": "5xx not on purpose (must be 0)", "value": result["five_xx_not_on_purpose"]},
        {"measure": "blocks held at the end (must be 0)", "value": result["blocks_held_at_end"]},
        {"measure": "requests admitted / ended / live / dropped",
         "value": "{admitted} / {ended} / {live} / {dropped}".format(**result["host"])},
        {"measure": "requests unanswered (must be 0)", "value": result["unanswered"]},
        {"measure": "broken responses (must be 0)", "value": result["outcomes"].get("broken", 0)},
        {"measure": "attacks held / run (skipped: no replicas, or met the soak's own disruption)",
         "value": f"{sum(a['held'] is True for a in result['attacks'])} / "
                  f"{sum(a['held'] is not None for a in result['attacks'])} "
                  f"({sum(a['held'] is None for a in result['attacks'])})"},
        {"measure": "engine restart (s)" if args.data_parallel_size == 1 else "replicas killed",
         "value": result["restart_s"] if args.data_parallel_size == 1 else result["replicas_killed"]},
        {"measure": "resident memory warm / end (MiB)",
         "value": f"{settled:,.0f} / {result['rss_mib'][-1][1]:,.0f} ({result['rss_mib'][-1][1] / settled - 1:+.1%})"},
        {"measure": "requests left in the engine", "value": ", ".join(f"{k} {v}" for k, v in leftovers.items())},
        {"measure": "/health polls, p50 / p99 (ms)",
         "value": f"{result['health_polls']}, {result['health_p50_ms']:.1f} / {result['health_p99_ms']:.1f}"},
    ]


def main(args) -> int:
    from nanoserve.config import EngineConfig

    config = EngineConfig.from_flags(**engine_flags(args))
    result = soak(config, args)
    rows = [{"outcome": k, "requests": n} for k, n in result["outcomes"].items()]
    disruption = (f"restart to {args.restart_flags or 'none'}, {result['faults_injected']} faults injected"
                  if args.data_parallel_size == 1 else
                  f"{args.data_parallel_size} replicas, {result['replicas_killed']} killed")
    print_table(f"bench soak: {result['requests_sent']} requests in {result['duration_s']:.0f} s, "
                f"{args.clients} clients, {disruption}", rows, ["outcome", "requests"])
    print_table("resident memory over time", [{"seconds": round(t), "MiB": round(mib)} for t, mib in result["rss_mib"]],
                ["seconds", "MiB"])
    summary = _summary(result, args)
    print_table("account", summary, ["measure", "value"])
    for line in result["broken"]:
        print("  broken:", line)
    path = write_results(args.out, "soak", {**result, "summary": summary}, rows, args)
    print(f"\nwrote {path}")
    problems = clean(result)
    for p in problems:
        print("NOT CLEAN:", p)
    return 1 if problems else 0
