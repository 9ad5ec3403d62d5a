#!/usr/bin/env python3
"""Single-stream decode of nanoserve and llama.cpp on one GGUF file, in one process, round by round in turn.

Separate processes (`scripts/decode-parts.py`, `bench sizes`) see this machine's memory bandwidth move between
them by up to 25%, more than the difference they measure. Here both engines are loaded at once and their rounds
alternate (the order flipping every round), each round timing `--tokens` greedy tokens after a 16-token prompt less
the time of one token, as `bench sizes` does; only one engine runs at a time (both pools' threads sleep when idle).
The figure is the median over rounds of each round pair's ratio, nanoserve / llama.cpp.

    python scripts/decode-pairs.py FILE.gguf [--rounds 8] [--tokens 33] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PROMPT = [1000 + i for i in range(16)]


def nanoserve_timer(path: str):
    from nanoserve import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=640, kv_cache_gib=0.25, enable_prefix_caching=False)
    mover = llm.engine.runner.loaded.fused.huge_pages if llm.engine.runner.loaded.fused else None
    if mover is not None:
        mover.done.wait()  # the steady state: the weights on huge pages where the system allows it

    def run(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": PROMPT}],
                     SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started
    return run


def llama_cpp_timer(path: str, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=640, verbose=False)

    def run(tokens: int) -> float:
        started, made = time.perf_counter(), 0
        for _ in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == tokens:
                break
        return time.perf_counter() - started
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve.bench.common import machine

    timers = {"nanoserve": nanoserve_timer(args.path), "llama.cpp": llama_cpp_timer(args.path, args.threads)}
    for run in timers.values():
        run(4)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in timers}
    for round_ in range(args.rounds):
        for name in list(timers) if round_ % 2 == 0 else list(timers)[::-1]:
            run = timers[name]
            rates[name].append((args.tokens - 1) / (run(args.tokens) - run(1)))
    ratios = [a / b for a, b in zip(rates["nanoserve"], rates["llama.cpp"])]
    print(f"{args.path}, {args.threads} threads, {args.rounds} rounds in turn; decode tok/s")
    print(f"{'round':>5} {'nanoserve':>10} {'llama.cpp':>10} {'ratio':>6}")
    for i, (a, b, r) in enumerate(zip(rates["nanoserve"], rates["llama.cpp"], ratios)):
        print(f"{i + 1:>5} {a:>10.2f} {b:>10.2f} {r:>6.3f}")
    print(f"median ratio {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": args.path, "threads": args.threads, "tokens": args.tokens, "machine": machine(),
                       "rates": rates, "ratios": ratios, "median_ratio": statistics.median(ratios)}, f, indent=1)


if __name__ == "__main__":
    main()
