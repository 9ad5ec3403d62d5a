#!/usr/bin/env python3
"""The K-quant kernels' speed on one 8192 x 2048 weight of each type (random bytes, finite f16 scales), 1 and 64
activation rows, and the machine's read bandwidth (torch summing 1 GiB): the kernel and bound figures BENCHMARKS.md
quotes. Prints a table; `--json PATH` writes it too.

    python scripts/kquant-speed.py [--threads 2] [--types Q4_K Q6_K ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

# where each type keeps its f16 scales within a block, and its block (inputs, bytes)
LAYOUT = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "IQ4_XS": (256, 136, (0,)),
          "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)), "IQ4_NL": (32, 18, (0,))}


def weight(type_name: str, out: int, k: int) -> torch.Tensor:
    inputs, size, halves = LAYOUT[type_name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out * k // inputs, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(out, -1))


def seconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--types", nargs="+", default=list(LAYOUT))
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve.kernels.fused import load

    kernels, why = load()
    if kernels is None:
        raise SystemExit(f"kquant-speed: the fused kernels cannot run here: {why}")
    out, k, rows_out = 8192, 2048, []
    for type_name in args.types:
        raw = weight(type_name, out, k)
        for rows in (1, 64):
            x = torch.randn(rows, k)
            s = seconds(lambda t=type_name, w=raw, a=x: kernels.kq_matmul(t, w, a), 20 if rows == 1 else 3)
            rows_out.append({"type": type_name, "rows": rows, "ms": s * 1e3, "weight_gb_s": raw.numel() / s / 1e9,
                             "gflop_s": 2 * rows * out * k / s / 1e9})
    big = torch.ones(256 * 2**20)
    bandwidth = 2**30 / seconds(big.sum, 5) / 1e9
    print(f"kernels {kernels.kq_isa}, {args.threads} threads; read bandwidth {bandwidth:.1f} GB/s (summing 1 GiB)")
    print(f"{'type':>7} {'rows':>4} {'ms':>8} {'weight GB/s':>11} {'GFLOP/s':>8}")
    for r in rows_out:
        print(f"{r['type']:>7} {r['rows']:>4} {r['ms']:>8.2f} {r['weight_gb_s']:>11.1f} {r['gflop_s']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": kernels.kq_isa, "threads": args.threads, "bandwidth_gb_s": bandwidth,
                       "shape": [out, k], "results": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
