#!/usr/bin/env python3
"""--read-ahead's decode figure: one engine, the chain on for every other decode step of the same generations.

Each step is timed from one forward's start to the next's (the step's forward, its sampling and the engine's
work around it: the gap after the head is where a step's first weight is read ahead); steps with the chain on and
off alternate, so a machine's drift reaches both alike, which separate runs on a shared 2-core machine do not
allow for a few-percent effect. Prints a table (median step ms each way, off / on) and, with `--json`, writes it.

    python scripts/read-ahead-ab.py FILE.gguf [--generations 6] [--tokens 129] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def alternating_steps(llm, generations: int, tokens: int) -> dict[bool, list[float]]:
    """Step milliseconds with the chain on (True) and off (False), alternating step by step."""
    from nanoserve import SamplingParams
    from nanoserve.model.quant.linears import PackedLinear

    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.read_chain is not None]
    if not linears:
        raise SystemExit("read-ahead-ab: no linear reads ahead here (fused kernels off, or --no-read-ahead)")
    chain, forward = linears[0].read_chain, model.forward
    state, steps = {"started": None, "on": False}, {True: [], False: []}

    def timed_forward(*args, **kwargs):
        now = time.perf_counter_ns()
        if state["started"] is not None:
            steps[state["on"]].append((now - state["started"]) / 1e6)
        state["on"] = not state["on"]
        for linear in linears:
            linear.read_chain = chain if state["on"] else None
        if not state["on"]:
            chain.kernels.read_ahead(None, 0)  # the last step's hint read into this one's first gap is not its own
        state["started"] = now
        return forward(*args, **kwargs)

    model.forward = timed_forward
    prompt = [{"prompt_token_ids": [1000 + i for i in range(16)]}]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps[True].clear(), steps[False].clear()
    for _ in range(generations):
        state["started"] = None  # a generation's first forward is its prefill: not a decode step's end
        llm.generate(prompt, params, use_tqdm=False)
    model.forward = forward
    for linear in linears:
        linear.read_chain = chain
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--generations", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=129)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve import LLM

    llm = LLM(model=args.path, max_model_len=args.tokens + 64, kv_cache_gib=0.1, enable_prefix_caching=False)
    kernels = llm.engine.runner.loaded.fused.kernels
    asked = kernels.read_ahead_bytes
    steps = alternating_steps(llm, args.generations, args.tokens)
    asked = (kernels.read_ahead_bytes - asked) / max(len(steps[True]), 1)
    on, off = statistics.median(steps[True]), statistics.median(steps[False])
    print(f"{args.path}: {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"{len(steps[True])} steps each way, alternating")
    print(f"{'read ahead':>10} {'step ms':>8} {'tok/s':>7}")
    print(f"{'on':>10} {on:>8.2f} {1e3 / on:>7.1f}")
    print(f"{'off':>10} {off:>8.2f} {1e3 / off:>7.1f}")
    print(f"off / on {off / on:.3f}; the worker asked for {asked / 2**20:.1f} MiB a step with it on")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "threads": args.threads, "steps_each": len(steps[True]),
                       "on_ms": steps[True], "off_ms": steps[False], "median_on_ms": on, "median_off_ms": off,
                       "off_over_on": off / on, "asked_mib_per_step": asked / 2**20}, f, indent=1)


if __name__ == "__main__":
    main()
