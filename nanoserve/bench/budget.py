"""`nanoserve bench budget`: a stream beside an arriving long prompt, with the step-time budget on and off.

What a person chatting feels when someone else sends a long prompt: the gaps between the stream's chunks once
the long prompt arrives (p50, p99, max), against the same stream's median gap alone on the server (quiet_p50:
the pace its reader is used to; max_over_quiet is the freeze they notice), and that prompt's time to first
token beside the stream against its time on an idle server. Each arm is a live server in this process (the budget's default, and
`--max-step-ms 0`, the token budget alone), the rounds interleaved so a noisy machine hits both alike; every long
prompt is new (no prefix-cache hit).
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import httpx

from nanoserve.bench.common import print_table, write_results
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.stats import percentiles

ARMS = {"budget on (default)": {}, "budget off (--max-step-ms 0)": {"max_step_ms": 0}}


def add_parser(sub) -> None:
    p = sub.add_parser("budget", help="a stream's inter-token gaps while a long prompt arrives, step-time budget "
                                      "on and off")
    p.add_argument("--long-prompt", type=int, default=1750, help="tokens of the prompt that arrives")
    p.add_argument("--stream-tokens", type=int, default=200, help="tokens the running stream generates")
    p.add_argument("--arrive-after", type=int, default=20, help="stream tokens before the long prompt is sent")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--also-ms", type=float, nargs="*", default=[], metavar="MS",
                   help="more arms, each with the budget's target set to MS (--max-step-ms MS)")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def stream_gaps(url: str, n: int, arrived: threading.Event, gaps: list[float], seen: list[int],
                model: str = "bench", quiet: list[float] | None = None) -> None:
    """Stream an n-token completion from `url`, counting its chunks in `seen` and adding the gap before each
    chunk (seconds) to `gaps` once `arrived` is set, to `quiet` (when given) before."""
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True}
    last = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            seen.append(1)
            if last is not None and arrived.is_set():
                gaps.append(now - last)
            elif last is not None and quiet is not None:
                quiet.append(now - last)
            last = now


def _ttft(url: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=600,
                      json={"model": "bench", "prompt": prompt, "max_tokens": 2, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - started
    raise RuntimeError("the long prompt's stream ended without a token")


def _round(url: str, args, rng: random.Random, vocab: int) -> dict:
    """One idle TTFT, the stream alone (its quiet gaps), then the stream with the long prompt arriving beside it."""
    def fresh() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.long_prompt)]

    idle = _ttft(url, fresh())
    quiet = []
    stream_gaps(url, args.stream_tokens, threading.Event(), [], [], quiet=quiet)
    arrived, gaps, seen = threading.Event(), [], []
    stream = threading.Thread(target=stream_gaps, args=(url, args.stream_tokens, arrived, gaps, seen))
    stream.start()
    while len(seen) < args.arrive_after and stream.is_alive():
        time.sleep(0.005)
    arrived.set()
    beside = _ttft(url, fresh())
    stream.join()
    return {"idle_ttft_s": idle, "ttft_s": beside, "gaps": gaps, "quiet_gaps": quiet}


def _row(arm: str, rounds: list[dict]) -> dict:
    gaps = [g for r in rounds for g in r["gaps"]]
    quiet = statistics.median(g for r in rounds for g in r["quiet_gaps"])
    p50, p99 = percentiles(gaps, 0.5, 0.99)
    idle, beside = (statistics.median(r[k] for r in rounds) for k in ("idle_ttft_s", "ttft_s"))
    return {"arm": arm, "quiet_p50_ms": 1000 * quiet, "gap_p50_ms": 1000 * p50, "gap_p99_ms": 1000 * p99,
            "gap_max_ms": 1000 * max(gaps), "max_over_median": max(gaps) / p50,
            "max_over_quiet": max(gaps) / quiet, "long_ttft_s": beside, "idle_ttft_s": idle,
            "ttft_over_idle": beside / idle}


def main(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.server.serve import Server

    flags = engine_flags(args)
    arms = {**ARMS, **{f"budget --max-step-ms {ms:g}": {"max_step_ms": ms} for ms in args.also_ms}}
    servers = {arm: Server(EngineConfig.from_flags(**{**flags, **extra}), port=0, served_model_name="bench").start()
               for arm, extra in arms.items()}
    try:
        vocab = next(iter(servers.values())).engine.model_config.vocab_size
        rng = random.Random(0)
        results = {arm: [] for arm in servers}
        for _ in range(args.rounds):
            for arm, server in servers.items():
                results[arm].append(_round(server.url, args, rng, vocab))
        budgets = {arm: httpx.get(s.url + "/health").json().get("step_budget") for arm, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    rows = [_row(arm, rounds) for arm, rounds in results.items()]
    print_table(f"a {args.stream_tokens}-token stream; a {args.long_prompt}-token prompt arrives after "
                f"{args.arrive_after} of its tokens ({args.rounds} rounds, arms interleaved, medians)", rows,
                list(rows[0]))
    for arm, budget in budgets.items():
        print(f"{arm}: step budget {budget}")
    path = write_results(args.out, "budget", {"rounds": results, "step_budget": budgets}, rows, args)
    print(f"wrote {path}")
    return 0
