#!/usr/bin/env python3
"""Where a single-stream decode token's time goes, on one GGUF file: the model's forward (its output head apart) and
the engine's step around it, and the fused CPU ops (norms, rotary + KV write, attention, silu) within the forward;
or, with `--llama-cpp`, llama.cpp's token time on the same file alone in this process (no nanoserve loaded, so
neither engine's threads share the cores with the other's). Run the two in turn, as separate processes, for the
comparison a shared machine's drift moves least. Each round times 65 greedy tokens after a 16-token prompt less the
time of one (the prompt's prefill), as `bench sizes` does. Prints a table; `--json PATH` writes it.

    python scripts/decode-parts.py FILE.gguf [--rounds 5] [--threads 2] [--llama-cpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PROMPT = [1000 + i for i in range(16)]
TOKENS = 65


def timed(owner, name: str, spent: dict, key: str) -> None:
    """Replace owner.name by a wrapper adding its nanoseconds to spent[key]."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        started = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0) + time.perf_counter_ns() - started

    setattr(owner, name, call)


def nanoserve_rounds(path: str, rounds: int) -> list[dict]:
    from nanoserve import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=640, kv_cache_gib=0.25, enable_prefix_caching=False)  # 640 slots at 8B
    model, spent = llm.engine.runner.model, {}
    timed(model, "forward", spent, "forward")
    timed(model.lm_head, "forward", spent, "head")
    if model.fused is not None:
        for op in ("add_norm", "rope_store", "attention", "silu_mul"):
            timed(model.fused, op, spent, op)
    prompts = [{"prompt_token_ids": PROMPT}]

    def run(tokens: int) -> tuple[float, dict]:
        spent.clear()
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started, dict(spent)

    run(4)  # warm-up
    out = []
    for _ in range(rounds):
        (t1, s1), (tn, sn) = run(1), run(TOKENS)
        per = {k: (sn.get(k, 0) - s1.get(k, 0)) / (TOKENS - 1) / 1e6 for k in sn}
        token = (tn - t1) / (TOKENS - 1) * 1e3
        row = {"token_ms": token, "forward_ms": per["forward"], "head_ms": per["head"],
               "layers_ms": per["forward"] - per["head"], "outside_forward_ms": token - per["forward"]}
        row |= {f"{op}_ms": per[op] for op in ("add_norm", "rope_store", "attention", "silu_mul") if op in per}
        out.append(row)
    return out


def llama_cpp_rounds(path: str, rounds: int, threads: int) -> list[dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=640, verbose=False)

    def run(tokens: int) -> float:
        started, made = time.perf_counter(), 0
        for _ in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == tokens:
                break
        return time.perf_counter() - started

    run(4)  # warm-up
    return [{"token_ms": (run(TOKENS) - run(1)) / (TOKENS - 1) * 1e3} for _ in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-cpp", action="store_true", help="time llama.cpp alone instead")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve.bench.common import machine

    engine = "llama.cpp" if args.llama_cpp else "nanoserve"
    rows = llama_cpp_rounds(args.path, args.rounds, args.threads) if args.llama_cpp else \
        nanoserve_rounds(args.path, args.rounds)
    medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print(f"{engine}, {args.path}, {args.threads} threads: ms a decode token, medians of {args.rounds} rounds")
    for key, value in medians.items():
        print(f"{key:>20} {value:8.2f}")
    print(f"{'tok/s':>20} {1e3 / medians['token_ms']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": engine, "file": args.path, "threads": args.threads, "machine": machine(),
                       "rounds": rows, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    main()
