#!/usr/bin/env python3
"""Packed weights on huge pages against 4 KiB pages, in one process: the witness of kernels/pages.py.

Each type's weight (random blocks, as `scripts/kquant-speed.py` makes them) is copied into two sets of buffers
filling `--mib` each, one from torch's allocator (4 KiB pages unless THP_MEM_ALLOC_ENABLE is set) and one from
`weight_buffer`, moved onto huge pages by `HugePageMover` as a load does (the share it moved is printed), and
one-row calls run through every copy of a set, so
each call reads its weight from memory as a decode step does; the sets alternate round by round. Medians of the
weight bytes a second each set streams.

    python scripts/weight-pages-ab.py [--types Q4_K Q6_K Q4_0] [--rounds 12] [--mib 768] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"Q4_K": (8192, 3072), "Q6_K": (3072, 8192), "Q4_0": (8192, 3072)}  # an up and a down projection


def _weights():
    spec = importlib.util.spec_from_file_location("kquant_speed", ROOT / "scripts" / "kquant-speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_row_call(kernels, type_name: str, out: int, k: int):
    x, y = torch.randn(1, k), torch.empty(1, out)
    if type_name == "Q4_0":
        return lambda w: kernels.q4x8_call(w.data_ptr(), x.data_ptr(), 1, k, out, None, y.data_ptr(),
                                           torch.get_num_threads(), 0)
    kind = kernels.kx16_types[type_name]
    return lambda w: kernels.kx16_call(kind, w.data_ptr(), x.data_ptr(), 1, k, out, out, None, y.data_ptr(),
                                       torch.get_num_threads(), 0)


def packed(kernels, type_name: str, out: int, k: int) -> torch.Tensor:
    raw = _weights().weight("Q4_0/q4x8" if type_name == "Q4_0" else type_name, out, k)
    if type_name == "Q4_0":
        return kernels.q4x8_pack_gguf((raw,), k)
    return kernels.kx16_pack(type_name, raw, k)


def moved_share(buffers: list[torch.Tensor]) -> float:
    """Moves `buffers` onto huge pages as a load does; the share of their whole huge pages the kernel moved."""
    from torch import nn

    from nanoserve.kernels.pages import HugePageMover

    holder = nn.Module()
    for i, buffer in enumerate(buffers):
        holder.register_buffer(f"w{i}", buffer)
    mover = HugePageMover(holder).start()
    mover.done.wait()
    if mover.stopped:
        raise SystemExit(f"weight-pages-ab: the weights stay on small pages here: {mover.stopped}")
    return mover.moved / max(mover.total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--mib", type=int, default=768, help="each set's size (well past the last-level cache)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanoserve.bench.common import machine
    from nanoserve.kernels import fused
    from nanoserve.kernels.pages import weight_buffer

    kernels, why = fused.load()
    if kernels is None:
        raise SystemExit(f"weight-pages-ab: the fused kernels are not available here: {why}")
    rows = []
    print(f"{args.threads} threads, one-row calls, medians of {args.rounds} alternated rounds, GB/s of weight read")
    print(f"{'type':>5} {'shape':>10} {'4 KiB':>7} {'huge':>7} {'huge/4k':>8} {'moved':>6}")
    for type_name in args.types:
        out, k = SHAPES[type_name]
        weight = packed(kernels, type_name, out, k)
        count = (args.mib << 20) // weight.numel() + 1
        sets = {"small": [torch.empty(weight.numel(), dtype=torch.uint8) for _ in range(count)],
                "huge": [weight_buffer(weight.numel()) for _ in range(count)]}
        for copy in sets["small"] + sets["huge"]:
            copy.copy_(weight)
        moved = moved_share(sets["huge"])
        call, rates = one_row_call(kernels, type_name, out, k), {"small": [], "huge": []}
        for round_ in range(args.rounds):
            for side in ("small", "huge") if round_ % 2 else ("huge", "small"):
                started = time.perf_counter()
                for copy in sets[side]:
                    call(copy)
                rates[side].append(weight.numel() * count / (time.perf_counter() - started) / 1e9)
        small, huge = statistics.median(rates["small"]), statistics.median(rates["huge"])
        rows.append({"type": type_name, "shape": [out, k], "small_gb_s": small, "huge_gb_s": huge,
                     "huge_over_small": huge / small, "moved_share": moved})
        print(f"{type_name:>5} {out:>5}x{k:<4} {small:>7.1f} {huge:>7.1f} {huge / small:>8.3f} {moved:>6.0%}")
        del sets
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "mib": args.mib, "machine": machine(),
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
