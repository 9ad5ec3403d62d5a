#!/usr/bin/env python3
"""Single-stream decode of one GGUF file by nanoserve and by llama.cpp (llama-cpp-python) in one process,
alternating round by round: the ratio a shared machine's drift moves least (`nanoserve bench sizes` loads each
engine in a fresh process, where a neighbour's memory traffic in one round lands on one engine only). Each round
times `--tokens` greedy tokens after a 16-token prompt less the time of one token (the prompt's prefill), as
`bench sizes` does. Prints a table; `--json PATH` writes it with the machine's description.

    python scripts/decode-vs-llama-cpp.py FILE.gguf [--rounds 5] [--tokens 64] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def nanoserve_timer(path: str):
    from nanoserve import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=512, kv_cache_gib=0.25, enable_prefix_caching=False)  # 512 slots at 8B
    fused = llm.engine.runner.loaded.fused
    if fused is not None and fused.huge_pages is not None:
        fused.huge_pages.done.wait()  # the steady state: the packed weights moved onto huge pages (kernels/pages.py)
    prompt = [{"prompt_token_ids": list(range(100, 116))}]

    def seconds(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - started

    return seconds


def llama_cpp_timer(path: str, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    prompt = list(range(100, 116))

    def seconds(tokens: int) -> float:
        started, made = time.perf_counter(), 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == tokens:
                break
        return time.perf_counter() - started

    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve.bench.common import machine

    engines = {"nanoserve": nanoserve_timer(args.path),
               "llama.cpp": llama_cpp_timer(args.path, args.threads)}
    for seconds in engines.values():
        seconds(4)  # warm-up
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        row = {name: (args.tokens - 1) / (engines[name](args.tokens) - engines[name](1)) for name in order}
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{n} {row[n]:.2f} tok/s" for n in engines)
              + f", ratio {row['nanoserve'] / row['llama.cpp']:.2f}", flush=True)
    medians = {n: statistics.median(r[n] for r in rounds) for n in engines}
    ratio = statistics.median(r["nanoserve"] / r["llama.cpp"] for r in rounds)
    print(f"\n{'engine':>10} {'median tok/s':>12}\n" + "\n".join(f"{n:>10} {v:>12.2f}" for n, v in medians.items()))
    print(f"median of the rounds' ratios nanoserve / llama.cpp: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": args.path, "tokens": args.tokens, "machine": machine(), "rounds": rounds,
                       "medians": medians, "median_ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
