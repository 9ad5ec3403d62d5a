"""`nanoserve bench wire`: the two reads side by side over a growing decode run, no weights involved.

For each (rows, tile) a random block pool holds rows that start from a 16-token prompt and grow one token a
step; every step both reads run on the same query through PagedRead, so their counters are the ones the engine
publishes. Reported: whether the outputs agree (max difference under 1e-4), reads, score cells charged, cells
held, saving (charged / held), ms per read and the streamed read's time over the gathered one's. A second table
counts the decode shapes each read needs captured (the streamed read has no width axis).
"""

from __future__ import annotations

import time

import torch

from nanoserve.attention.dispatch import PagedRead
from nanoserve.bench.common import print_table, write_results
from nanoserve.runner.decode.buckets import DecodeBuckets


def add_parser(sub) -> None:
    p = sub.add_parser("wire", help="gathered vs streamed read: agreement, cells charged vs held, ms per read")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32], help="streamed tile widths")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench-results")


def run(rows: int, tile: int | None, args, seed: int = 0) -> dict:
    dev, bs = torch.device(args.device), 16
    gen = torch.Generator().manual_seed(seed)
    longest = args.prompt_len + args.steps
    per_row = -(-longest // bs)
    shape = (rows * per_row + 1, bs, args.kv_heads, args.head_dim)
    k, v = torch.randn(shape, generator=gen).to(dev), torch.randn(shape, generator=gen).to(dev)
    table = (torch.arange(rows * per_row).view(rows, per_row) + 1).to(dev)
    reads = {"gathered": PagedRead("gathered"), "streamed": PagedRead("streamed", tile)}
    seconds = {name: 0.0 for name in reads}
    worst = 0.0
    for step in range(args.steps):
        n = args.prompt_len + step + 1
        lens = torch.full((rows,), n, device=dev)
        window = table[:, : -(-n // bs)]
        q = torch.randn(rows, args.heads, args.head_dim, generator=gen).to(dev)
        outs = {}
        for name, read in reads.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            outs[name] = read.decode(q, k, v, window, lens, args.head_dim**-0.5)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - started
        worst = max(worst, (outs["gathered"] - outs["streamed"]).abs().max().item())
    s, g = reads["streamed"].stats(), reads["gathered"].stats()
    ms = {name: seconds[name] * 1000 / args.steps for name in reads}
    return {"rows": rows, "prompt": args.prompt_len, "steps": args.steps, "block": tile,
            "same": "yes" if worst < 1e-4 else f"no ({worst:.1e})", "reads": s.calls, "charged": s.score_cells,
            "held": s.held_cells, "saving": s.saving, "ms_per_read": ms["streamed"],
            "gathered_ms_per_read": ms["gathered"], "vs_rect": ms["streamed"] / ms["gathered"],
            "gathered_held": g.held_cells}


def shape_counts() -> list[dict]:
    out = []
    for rows, context in ((64, 2048), (256, 8192), (256, 32768)):
        blocks = context // 16
        out.append({"max_num_seqs": rows, "max_model_len": context,
                    "gathered_shapes": len(DecodeBuckets(rows, blocks).shapes),
                    "streamed_shapes": len(DecodeBuckets(rows, blocks, width_axis=False).shapes)})
    return out


def main(args) -> int:
    rows = [run(r, tile, args) for r in args.rows for tile in args.blocks]
    print_table(f"the wired decode read on {args.device}: {args.heads} heads / {args.kv_heads} kv heads, head_dim "
                f"{args.head_dim}, contexts {args.prompt_len + 1}..{args.prompt_len + args.steps}", rows,
                ["rows", "prompt", "steps", "block", "same", "reads", "charged", "held", "saving", "ms_per_read",
                 "gathered_ms_per_read", "vs_rect"])
    shapes = shape_counts()
    print_table("decode shapes to capture (rows x widths for the gathered read; rows only for the streamed)",
                shapes, list(shapes[0]))
    print(f"wrote {write_results(args.out, 'wire', {'shapes': shapes}, rows, args)}")
    return 0
