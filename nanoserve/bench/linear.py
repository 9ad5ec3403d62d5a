"""`nanoserve bench linear`: how fast this machine runs the decoder's projections, by row count: torch's dense
matmuls and nanoserve's own 4- and 8-bit kernels (kernels/linear.c), with and without the AMX tiles.

Decode speed on a CPU is set by these products, so the table says what any engine on this box can reach:
one row is a matrix-vector product that only streams weights (GB/s), many rows approach the GEMM ceiling
(GFLOPS). Weights are distinct tensors per layer, as in a real step, so they come from memory, not cache.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from nanoserve.bench.common import memory_bandwidth_gbs, print_table, write_results

# SmolLM2-135M's projections (qkv, o, gate_up, down) over its 30 layers: the default model's decode step.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv: 9 query heads and 3 KV heads of 64
LAYERS = 30


KERNEL_ARMS = ("q4x16", "q4x16-amx", "q8x16", "q8x16-amx")  # the fused library's kernels; -amx: the tile unit on
# A cell stops repeating once its calls have taken this long: a slow one (bf16 where the CPU has no bf16 units)
# gets one timed call instead of holding up the table.
CELL_BUDGET_S = 2.0


def add_parser(sub) -> None:
    p = sub.add_parser("linear", help="projection speed (GB/s, GFLOPS) by rows: fp32, bf16 and nanoserve's "
                                      "4- and 8-bit kernels (vector path and AMX tiles)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="row counts to time (default 1 4 16 64: decode's batches; add 256 2048 for the GEMM "
                        "ceiling, minutes on a small CPU)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", *KERNEL_ARMS],
                   help=f"torch dtypes, and any of {', '.join(KERNEL_ARMS)} (left out where the fused kernels "
                        "or the tiles cannot run)")
    p.add_argument("--repeats", type=int, default=3,
                   help=f"timed calls per cell, best kept (fewer where a cell's calls pass {CELL_BUDGET_S:.0f} s)")
    p.add_argument("--out", default="bench-results")


def _kernel_arms(names: list[str]) -> dict:
    """name -> (the step's products as a callable of rows, the packed bytes), for the kernel arms this machine
    runs: random codes and float16-exact scales, packed as the loader packs a file's blocks."""
    from nanoserve.kernels.fused import load

    wanted = [n for n in names if n in KERNEL_ARMS]
    kernels, why = load() if wanted else (None, "")
    if kernels is None:
        if wanted:
            print(f"left out {', '.join(wanted)}: {why}")
        return {}
    arms = {}
    for name in wanted:
        tiles = name.endswith("-amx")
        if tiles and kernels.tiles == "none":
            print(f"left out {name}: no AMX tiles here")
            continue
        eight = name.startswith("q8")
        packed = []
        for _ in range(LAYERS):
            for o, i in SHAPES:
                scales = (torch.rand(o, i // 32) * 0.01 + 1e-3).half().float()
                if eight:
                    packed.append((kernels.q8_pack(torch.randint(-128, 128, (o, i), dtype=torch.int8), scales), o))
                else:
                    codes = torch.randint(0, 16, (o, i), dtype=torch.uint8)
                    packed.append((kernels.q4_pack(codes, scales, scales * 0.1), o))
        matmul = kernels.q8_matmul if eight else kernels.q4_matmul

        def step(xs, tiles=tiles, packed=packed, matmul=matmul):
            kernels.use_tiles(tiles)
            try:
                return [matmul(w, xs[w_in], o) for (w, o), w_in in zip(packed, _inputs())]
            finally:
                kernels.use_tiles(True)

        arms[name] = (step, sum(w.numel() for w, _ in packed))
    return arms


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of up to `repeats` timed calls after a warm-up, stopping early once CELL_BUDGET_S is spent;
    a warm-up that alone takes longer is the measurement (what warming saves is lost in a call that long)."""
    started = time.perf_counter()
    fn()
    best = time.perf_counter() - started
    if best > CELL_BUDGET_S:
        return best
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - started > CELL_BUDGET_S:
            break
    return best


def _inputs() -> list[int]:
    return [i for _ in range(LAYERS) for _, i in SHAPES]


def main(args) -> int:
    print(f"{LAYERS} layers of {len(SHAPES)} projections in {', '.join(args.dtypes)}; rows "
          f"{' '.join(map(str, args.rows))}, best of {args.repeats}", flush=True)
    dtypes = [dt for dt in args.dtypes if dt not in KERNEL_ARMS]
    weights = {dt: [torch.randn(o, i, dtype=getattr(torch, dt)) for _ in range(LAYERS) for o, i in SHAPES]
               for dt in dtypes}
    kernel_arms = _kernel_arms(args.dtypes)
    stream_gbs = memory_bandwidth_gbs(mib=256, repeats=args.repeats)
    params = sum(o * i for o, i in SHAPES) * LAYERS
    rows = []
    for m in args.rows:
        timed = {}
        for dt, ws in weights.items():
            xs = {i: torch.randn(m, i, dtype=ws[0].dtype) for _, i in SHAPES}
            timed[dt] = (_best_seconds(lambda ws=ws, xs=xs: [F.linear(xs[w.shape[1]], w) for w in ws],
                                       args.repeats), sum(w.nbytes for w in ws))
        xs = {i: torch.randn(m, i) for _, i in SHAPES}
        for name, (step, nbytes) in kernel_arms.items():
            timed[name] = (_best_seconds(lambda step=step, xs=xs: step(xs), args.repeats), nbytes)
        for dt, (t, nbytes) in timed.items():
            rows.append({"rows": m, "dtype": dt, "ms_per_step": t * 1e3, "weight_GB_s": nbytes / t / 1e9,
                         "GFLOPS": 2 * m * params / t / 1e9, "share_of_stream_bw": nbytes / t / 1e9 / stream_gbs})
        print(f"{m} rows: " + ", ".join(f"{dt} {t * 1e3:,.1f} ms" for dt, (t, _) in timed.items()), flush=True)
    print_table(f"projections of a 30-layer 576-wide decoder, {torch.get_num_threads()} threads "
                f"(streaming read bandwidth {stream_gbs:.1f} GB/s)", rows, list(rows[0]))
    path = write_results(args.out, "linear", {"stream_gbs": stream_gbs}, rows, args)
    print(f"wrote {path}")
    return 0
