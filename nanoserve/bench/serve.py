"""`nanoserve bench serve`: streamed requests from async httpx clients against a live server.

Reports what `vllm bench serve` reports (successful / failed requests, duration, request and output-token
throughput, TTFT, TPOT and ITL mean / median / p99). It polls /health during the run and refuses to report an
arm that was never crowded: a serving figure from one request at a time measures latency, not serving.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from nanoserve.bench.common import (
    SAMPLED,
    error_message,
    pick_prompts,
    print_table,
    sse_events,
    write_results,
)
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.stats import percentiles


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serving benchmark against a live server (or one it launches)")
    p.add_argument("--url", default=None, help="a running server's base URL; omitted: launch one in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    p.add_argument("--dataset", choices=("builtin", "synthetic"), default="builtin")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds synthetic prompts and arrivals")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the streamed deltas joined
    finish_reason: str | None = None


def make_bodies(num_prompts: int, dataset: str, input_len: int, output_len: int, prompt_seed: int, vocab: int,
                sampled: bool = False) -> list[dict]:
    """Streamed request bodies: builtin chat prompts or synthetic token prompts; greedy, or seeded sampling.

    Every request runs to `output_len` tokens (ignore_eos), so runs of the same shape do the same work.
    """
    rng = random.Random(prompt_seed)
    prompts = pick_prompts(num_prompts)
    bodies = []
    for i in range(num_prompts):
        if dataset == "builtin":
            body = {"messages": [{"role": "user", "content": prompts[i]}]}
        else:
            body = {"prompt": [rng.randrange(100, vocab) for _ in range(input_len)]}
        body.update(max_tokens=output_len, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        if sampled:
            body.update(SAMPLED, seed=prompt_seed * 100_003 + i)
        bodies.append(body)
    return bodies


async def one(http: httpx.AsyncClient, url: str, body: dict) -> Result:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    last = None
    res, parts = Result(ok=False), []
    try:
        async with http.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=error_message(r.status_code, await r.aread()))
            async for event in sse_events(r):
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                if not choices:
                    continue
                res.finish_reason = choices[0].get("finish_reason") or res.finish_reason
                text = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = repr(e)
    res.text = "".join(parts)
    return res


async def run(url: str, bodies: list[dict], concurrency: int, rate: float | None, headers: dict, seed: int,
              on_result=None, watch_health: bool = True):
    """Fire `bodies` and return (results, duration, peak running rows seen on /health).

    The peak is the largest `running` the polls saw, raised to the scheduler's own `peak_running` when that
    rose during the arm (a real maximum over steps, which a 0.1 s poll can miss when requests are short).
    `on_result(result)` hears each request as it ends. Cancelling the caller cancels every request in
    flight (their streams close, so the server aborts them and frees their blocks). With `watch_health`
    off, /health is not polled (no extra requests while step times are measured) and the peak is None.
    """
    limit = asyncio.Semaphore(concurrency if rate is None else len(bodies))
    peak = {"running": 0}
    done = asyncio.Event()
    rng = random.Random(seed)

    async with httpx.AsyncClient(timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=max(concurrency, 64) + 4)) as http:

        async def watch():
            while not done.is_set():
                try:
                    h = (await http.get(url + "/health")).json()
                    peak["running"] = max(peak["running"], h["scheduler"]["running"])
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)

        async def guarded(body):
            async with limit:
                result = await one(http, url, body)
            if on_result is not None:
                on_result(result)
            return result

        async def peak_so_far() -> int | None:
            try:
                return (await http.get(url + "/health")).json()["scheduler"]["peak_running"]
            except (httpx.HTTPError, KeyError, ValueError):
                return None

        peak_before = await peak_so_far() if watch_health else None
        watchers = [asyncio.create_task(watch())] if watch_health else []
        started = time.perf_counter()
        tasks = []
        try:
            for body in bodies:
                tasks.append(asyncio.create_task(guarded(body)))
                if rate is not None:
                    await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            done.set()
            await asyncio.gather(*watchers, *tasks, return_exceptions=True)
        duration = time.perf_counter() - started
        if watch_health:
            peak_after = await peak_so_far()
            if None not in (peak_before, peak_after) and peak_after > peak_before:
                peak["running"] = max(peak["running"], peak_after)
    return results, duration, peak["running"] if watch_health else None


def summarise(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0

    def stats(values):
        if not values:
            return None, None, None
        (p99,) = percentiles(values, 0.99)
        return statistics.fmean(values) * ms, statistics.median(values) * ms, p99 * ms

    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    row = {"successful": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "req_per_s": len(ok) / duration, "output_tok_per_s": out_tokens / duration}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", [x for r in ok for x in r.itls])):
        mean, median, p99 = stats(values)
        row.update({f"{name}_mean_ms": mean, f"{name}_median_ms": median, f"{name}_p99_ms": p99})
    return row


def main(args) -> int:
    server = None
    url = args.url
    if url is None:
        from nanoserve.config import EngineConfig
        from nanoserve.server.serve import Server

        server = Server(EngineConfig.from_flags(**engine_flags(args)), port=0).start()
        url = server.url
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        health = httpx.get(url + "/health", headers=headers).json()
        vocab = 32000
        if server is not None:
            vocab = server.engine.model_config.vocab_size
        bodies = make_bodies(args.num_prompts, args.dataset, args.input_len, args.output_len, args.prompt_seed, vocab)
        results, duration, crowd = asyncio.run(
            run(url, bodies, args.concurrency, args.request_rate, headers, args.prompt_seed))
    finally:
        if server is not None:
            server.stop()
    row = {"model": health.get("model"), "concurrency": args.concurrency if args.request_rate is None else None,
           "request_rate": args.request_rate, "peak_running_seen": crowd, **summarise(results, duration)}
    failures = [r.error for r in results if not r.ok]
    if failures:
        print(f"{len(failures)} requests failed, e.g. {failures[0]}")
    wanted = 2 if (args.request_rate is not None or args.concurrency > 1) else 1
    if crowd < wanted:
        print(f"refusing to report: the server never ran more than {crowd} request(s) at once during this arm "
              f"(wanted >= {wanted}); raise --concurrency, --num-prompts or --output-len so requests overlap")
        return 3
    columns = ["successful", "failed", "duration_s", "req_per_s", "output_tok_per_s", "peak_running_seen",
               "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_median_ms", "tpot_p99_ms",
               "itl_mean_ms", "itl_median_ms", "itl_p99_ms"]
    print_table(f"serving: {row['model']}, {args.num_prompts} prompts ({args.dataset}), "
                f"{'concurrency ' + str(args.concurrency) if args.request_rate is None else 'rate ' + str(args.request_rate)}, "
                f"{args.output_len} output tokens", [row], columns)
    path = write_results(args.out, "serve", {"result": row, "health_before": health}, [row], args)
    print(f"wrote {path}")
    return 0
