"""`nanoserve bench serve`: streamed requests from async httpx clients against a live server.

Reports what `vllm bench serve` reports (successful / failed requests, duration, request and output-token
throughput, TTFT, TPOT and ITL mean / median / p99). It polls /health during the run and refuses to report an
arm that was never crowded: a serving figure from one request at a time measures latency, not serving.
"""

from __future__ import annotations

import asyncio

import httpx

from nanoserve.bench.common import print_table, write_results
from nanoserve.client import fire, summarise
from nanoserve.flags import add_data_parallel_flags, add_engine_flags, engine_flags
from nanoserve.workload import DATASETS, make_bodies


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serving benchmark against a live server (or one it launches)")
    p.add_argument("--url", default=None, help="a running server's base URL; omitted: launch one in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    p.add_argument("--dataset", choices=DATASETS, default="builtin",
                   help="shared-prefix: 8 system prompts of --input-len tokens, each request one plus its own")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds synthetic prompts and arrivals")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--rounds", type=int, default=3, help="with --data-parallel-size: rounds over the arms")
    add_data_parallel_flags(p)
    add_engine_flags(p)


def main(args) -> int:
    if args.data_parallel_size > 1:  # DP=1 beside DP=N, and affinity beside round-robin (serve_dp.py)
        from nanoserve.bench.serve_dp import main as data_parallel_main

        return data_parallel_main(args)
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
            fire(url, bodies, args.concurrency, args.request_rate, headers, args.prompt_seed))
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
