"""The HTTP/SSE client the benchmarks and the console share: a streamed request timed token by token, a crowd of
them fired at a concurrency or a rate, and their summary as `vllm bench serve` reports it.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from nanoserve.stats import percentiles


async def sse_events(response) -> AsyncIterator[dict]:
    """Each `data: {...}` event of a streamed (server-sent events) response, parsed, until `data: [DONE]`.

    What follows [DONE] is read and dropped, so the connection ends cleanly and can serve the next request.
    """
    lines = response.aiter_lines()
    async for line in lines:
        if line == "data: [DONE]":
            async for _ in lines:
                pass
            return
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def error_message(status: int, raw: bytes) -> str:
    """A refused request as text: the status and the OpenAI error's message (or the start of the body)."""
    try:
        return f"HTTP {status}: {json.loads(raw)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw.decode(errors='replace')[:200]}"

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


async def stream_one(http: httpx.AsyncClient, url: str, body: dict) -> Result:
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


async def fire(url: str, bodies: list[dict], concurrency: int, rate: float | None, headers: dict, seed: int,
               on_result=None, watch_health: bool = True):
    """Fire `bodies` and return (results, duration, peak running rows seen on /health).

    The peak is the largest `running` the polls saw, raised to the scheduler's own `peak_running` when that
    rose during the arm (a real maximum over steps, which a 0.1 s poll can miss when requests are short).
    `on_result(result)` hears each request as it ends. Cancelling the caller cancels every request in
    flight (their streams close, so the server aborts them and frees their blocks). With `watch_health`
    off, /health is not polled (no extra requests while step times are measured) and the peak is None.
    """
    async with httpx.AsyncClient(timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=max(concurrency, 64) + 4)) as http:
        watch = PeakWatch(http, url) if watch_health else None
        if watch is not None:
            await watch.start()
        started = time.perf_counter()
        try:
            results = await _send_all(http, url, bodies, concurrency, rate, random.Random(seed), on_result)
        finally:
            if watch is not None:
                await watch.stop()
        duration = time.perf_counter() - started
    return results, duration, watch.peak if watch is not None else None


async def _send_all(http: httpx.AsyncClient, url: str, bodies: list[dict], concurrency: int, rate: float | None,
                    rng: random.Random, on_result) -> list[Result]:
    """Every body, at most `concurrency` in flight (or as Poisson arrivals at `rate`); all cancelled on exit."""
    limit = asyncio.Semaphore(concurrency if rate is None else len(bodies))

    async def guarded(body):
        async with limit:
            result = await stream_one(http, url, body)
        if on_result is not None:
            on_result(result)
        return result

    tasks = []
    try:
        for body in bodies:
            tasks.append(asyncio.create_task(guarded(body)))
            if rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PeakWatch:
    """The most rows a server ran at once during a run: /health polled every 0.1 s, and the scheduler's own
    `peak_running` read before and after (a short request can rise and fall between two polls)."""

    def __init__(self, http: httpx.AsyncClient, url: str):
        self.http, self.url, self.peak = http, url, 0
        self._done = asyncio.Event()
        self._before: int | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._before = await self._peak_so_far()
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        self._done.set()
        await asyncio.gather(self._task, return_exceptions=True)
        after = await self._peak_so_far()
        if None not in (self._before, after) and after > self._before:
            self.peak = max(self.peak, after)

    async def _poll(self) -> None:
        while not self._done.is_set():
            try:
                health = (await self.http.get(self.url + "/health")).json()
                self.peak = max(self.peak, health["scheduler"]["running"])
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)

    async def _peak_so_far(self) -> int | None:
        try:
            return (await self.http.get(self.url + "/health")).json()["scheduler"]["peak_running"]
        except (httpx.HTTPError, KeyError, ValueError):
            return None


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
