"""`nanoserve bench linear`: how fast this machine's torch runs the decoder's projections, by row count.

Decode speed on a CPU is set by these products, so the table says what any engine on this box can reach:
one row is a matrix-vector product that only streams weights (GB/s), many rows approach the GEMM ceiling
(GFLOPS). Weights are distinct tensors per layer, as in a real step, so they come from memory, not cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.bench.common import best_seconds, memory_bandwidth_gbs, print_table, write_results

# SmolLM2-135M's projections (qkv, o, gate_up, down) over its 30 layers: the default model's decode step.
SHAPES = ((1728, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def add_parser(sub) -> None:
    p = sub.add_parser("linear", help="projection speed (GB/s, GFLOPS) by rows, fp32 and bf16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 2048])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench-results")


def main(args) -> int:
    weights = {dt: [torch.randn(o, i, dtype=getattr(torch, dt)) for _ in range(LAYERS) for o, i in SHAPES]
               for dt in args.dtypes}
    stream_gbs = memory_bandwidth_gbs(mib=256, repeats=args.repeats)
    rows = []
    for m in args.rows:
        for dt, ws in weights.items():
            xs = {i: torch.randn(m, i, dtype=ws[0].dtype) for _, i in SHAPES}
            t = best_seconds(lambda ws=ws, xs=xs: [F.linear(xs[w.shape[1]], w) for w in ws], args.repeats)
            nbytes = sum(w.nbytes for w in ws)
            flops = 2 * m * sum(w.numel() for w in ws)
            rows.append({"rows": m, "dtype": dt, "ms_per_step": t * 1e3, "weight_GB_s": nbytes / t / 1e9,
                         "GFLOPS": flops / t / 1e9, "share_of_stream_bw": nbytes / t / 1e9 / stream_gbs})
    print_table(f"projections of a 30-layer 576-wide decoder, {torch.get_num_threads()} threads "
                f"(streaming read bandwidth {stream_gbs:.1f} GB/s)", rows, list(rows[0]))
    path = write_results(args.out, "linear", {"stream_gbs": stream_gbs}, rows, args)
    print(f"wrote {path}")
    return 0
