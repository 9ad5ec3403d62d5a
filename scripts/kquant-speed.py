#!/usr/bin/env python3
"""The packed kernels' speed on one 8192 x 2048 weight of each type (random bytes, finite f16 scales; 16-bit rows
of random normal values), 1, 8 and 64 activation rows, and the machine's read bandwidth (torch summing 1 GiB): the
kernel and bound figures BENCHMARKS.md quotes. The K-quant table's types (and F16, BF16), and GGUF's Q4_0 on q4x8
and q4x16 and Q4_1 on q4x16 (`Q4_0/q4x8` ...), and Q4_K, Q5_K and Q6_K interleaved as the loader runs them (`Q4_K/x16` ...). Prints a table; `--json PATH` writes it too.

    python scripts/kquant-speed.py [--threads 2] [--types Q4_K Q6_K Q4_0/q4x8 ...] [--json out.json]
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
HALF = ("F16", "BF16")
FOUR_BIT = ("Q4_0/q4x8", "Q4_0/q4x16", "Q4_1/q4x16")  # GGUF rows on linear.c's and q4x8.c's 4-bit kernels
INTERLEAVED = ("Q4_K/x16", "Q5_K/x16", "Q6_K/x16")  # rows 16 outputs interleaved (kx16.c), as the loader runs them


def weight(type_name: str, out: int, k: int) -> torch.Tensor:
    if type_name in HALF:  # real values: random bytes would be NaNs and subnormals, which float units slow down on
        w = torch.randn(out, k, generator=torch.Generator().manual_seed(0)) * 0.05
        return (w.half() if type_name == "F16" else w.bfloat16()).view(torch.uint8)
    if type_name in INTERLEAVED:
        return weight(type_name.split("/")[0], out, k)
    if "/" in type_name:
        type_name = type_name.split("/")[0]
        halves = (0,) if type_name == "Q4_0" else (0, 2)
        inputs, size = 32, 18 if type_name == "Q4_0" else 20
    else:
        inputs, size, halves = LAYOUT[type_name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out * k // inputs, size), dtype=np.uint8)
    for at in halves:
        raw[:, at:at + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(out, -1))


def product(kernels, type_name: str, raw: torch.Tensor, k: int):
    """x -> x . W^T on the kernel `type_name` names: the K-quant table's, or a 4-bit one's over GGUF rows."""
    if "/" not in type_name:
        return lambda x: kernels.kq_matmul(type_name, raw, x)
    if type_name in INTERLEAVED:
        from nanoserve.model.quant import KQuantBlocks
        from nanoserve.model.quant.linears import KQuantLinear

        linear = KQuantLinear(KQuantBlocks(((type_name.split("/")[0], raw),), k), None, None, kernels)
        return lambda x: linear(x)
    from nanoserve.model.quant.blocks import GgufInt4Rows
    from nanoserve.model.quant.linears import Q4Linear, Q4x8Linear

    gguf_type, kernel = type_name.split("/")
    linear = (Q4x8Linear if kernel == "q4x8" else Q4Linear)(GgufInt4Rows(gguf_type, (raw,), k), None, None, kernels)
    return lambda x: linear(x)


def seconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--types", nargs="+", default=[*LAYOUT, *INTERLEAVED, *HALF, *FOUR_BIT])
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
        run = product(kernels, type_name, raw, k)
        for rows in (1, 8, 64):
            x = torch.randn(rows, k)
            s = seconds(lambda a=x, f=run: f(a), 20 if rows == 1 else 5)
            rows_out.append({"type": type_name, "rows": rows, "ms": s * 1e3, "weight_gb_s": raw.numel() / s / 1e9,
                             "gflop_s": 2 * rows * out * k / s / 1e9})
    big = torch.ones(256 * 2**20)
    bandwidth = 2**30 / seconds(big.sum, 5) / 1e9
    print(f"kernels {kernels.kq_isa}, {args.threads} threads; read bandwidth {bandwidth:.1f} GB/s (summing 1 GiB)")
    print(f"{'type':>10} {'rows':>4} {'ms':>8} {'weight GB/s':>11} {'GFLOP/s':>8}")
    for r in rows_out:
        print(f"{r['type']:>10} {r['rows']:>4} {r['ms']:>8.2f} {r['weight_gb_s']:>11.1f} {r['gflop_s']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": kernels.kq_isa, "threads": args.threads, "bandwidth_gb_s": bandwidth,
                       "shape": [out, k], "results": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
