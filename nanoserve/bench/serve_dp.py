"""`nanoserve bench serve --data-parallel-size N`: one engine beside N replicas (the machine's threads split
among them, or a GPU each), and prefix-affinity routing beside round-robin, on the same requests.

Three servers run side by side (DP=1, DP=N routed by prefix affinity, DP=N in turn) and every round sends the
same requests to each, in an order that rotates, after resetting its prefix cache: so each arm starts cold, the
arms share the machine's drift, and the figures are medians over rounds with DP=N as a ratio to DP=1. The
prefix-cache hit rate is measured: the prompt tokens the replicas served from cached blocks over those they
looked up, from /health before and after the arm.
"""

from __future__ import annotations

import asyncio
import statistics

import httpx

from nanoserve.bench.common import print_table, write_results
from nanoserve.client import fire, summarise
from nanoserve.workload import make_bodies

MEANING = ("On this machine the replicas share the same cores one engine had, so DP=N trades one engine's "
           "threads for N engines of fewer threads each: expect no throughput gain here, and read the ratio as "
           "what the front end and the split cost. On a machine with cores (or GPUs) to spare each replica adds "
           "its own, and throughput scales with N while the hit-rate column shows how much prefill affinity "
           "saves over routing in turn.")


def arms(size: int) -> dict:
    """Arm name -> (data-parallel size, routing)."""
    return {"dp1": (1, "prefix-affinity"), f"dp{size}-affinity": (size, "prefix-affinity"),
            f"dp{size}-round-robin": (size, "round-robin")}


def _prefix_counts(url: str) -> tuple[int, int]:
    prefix = httpx.get(url + "/health", timeout=30).json()["prefix_cache"]
    return prefix["queries"], prefix["hits"]


def run_arm(url: str, bodies: list[dict], concurrency: int, seed: int) -> dict:
    httpx.post(url + "/reset_prefix_cache", timeout=60)
    queries, hits = _prefix_counts(url)
    results, duration, crowd = asyncio.run(fire(url, bodies, concurrency, None, {}, seed))
    queries2, hits2 = _prefix_counts(url)
    looked = queries2 - queries
    return {**summarise(results, duration), "peak_running_seen": crowd,
            "prefix_hit_rate": (hits2 - hits) / looked if looked else None}


def main(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.flags import engine_flags
    from nanoserve.server.serve import DataParallel, Server

    if args.url is not None:
        print("--data-parallel-size launches its own servers; leave out --url (run `nanoserve serve "
              "--data-parallel-size N` and `nanoserve bench serve --url` for a server of your own)")
        return 2
    config = EngineConfig.from_flags(**engine_flags(args))
    plan = arms(args.data_parallel_size)
    servers = {}
    try:
        for name, (size, routing) in plan.items():
            servers[name] = Server(config, port=0, data_parallel=DataParallel(size, args.data_parallel_backend,
                                                                              args.ray_address, routing)).start()
        vocab = httpx.get(next(iter(servers.values())).url + "/health").json().get("vocab_size") or 32000
        bodies = make_bodies(args.num_prompts, args.dataset, args.input_len, args.output_len, args.prompt_seed,
                             vocab)
        runs: dict[str, list[dict]] = {name: [] for name in plan}
        names = list(plan)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts with the next arm
                runs[name].append(run_arm(servers[name].url, bodies, args.concurrency, args.prompt_seed))
                print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]['output_tok_per_s']:.1f} output tok/s")
    finally:
        for server in servers.values():
            server.stop()
    rows = _rows(runs, plan)
    print_table(f"data parallelism: {args.num_prompts} {args.dataset} prompts ({args.input_len} tokens), "
                f"{args.output_len} output tokens, concurrency {args.concurrency}, median of {args.rounds} rounds",
                rows, list(rows[0]))
    print("\n" + MEANING)
    path = write_results(args.out, "serve-dp", {"rounds": runs, "meaning": MEANING}, rows, args)
    print(f"wrote {path}")
    return 0


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _rows(runs: dict, plan: dict) -> list[dict]:
    base = _median(r["output_tok_per_s"] for r in runs["dp1"])
    rows = []
    for name, (size, routing) in plan.items():
        tok_s = _median(r["output_tok_per_s"] for r in runs[name])
        ratios = [r["output_tok_per_s"] / b["output_tok_per_s"] for r, b in zip(runs[name], runs["dp1"])]
        rows.append({"arm": name, "replicas": size, "routing": routing if size > 1 else "-",
                     "output_tok_per_s": tok_s, "vs_dp1": statistics.median(ratios) if base else None,
                     "ttft_median_ms": _median(r["ttft_median_ms"] for r in runs[name]),
                     "tpot_median_ms": _median(r["tpot_median_ms"] for r in runs[name]),
                     "prefix_hit_rate": _median(r["prefix_hit_rate"] for r in runs[name]),
                     "failed": sum(r["failed"] for r in runs[name])})
    return rows
