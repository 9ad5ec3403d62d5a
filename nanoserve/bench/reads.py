"""`nanoserve bench reads` (CUDA): the streamed kernel against the gathered read, by batch and context.

Random pools in the serving dtype with a Llama-8B-like attention shape (32 heads, 8 kv heads, head_dim 128),
every row at the same context, tables scattered over the pool. Reported per (batch, context): ms per call for
each read (median of CUDA-event timings), the streamed read's effective bandwidth (the K/V bytes it must read
over its time) and that as a share of this card's measured copy bandwidth.
"""

from __future__ import annotations

import statistics

import torch

from nanoserve.attention.gathered import gathered_decode
from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.graphs import copy_bandwidth
from nanoserve.errors import ConfigError
from nanoserve.optional import available, install_hint


def add_parser(sub) -> None:
    p = sub.add_parser("reads", help="CUDA: streamed kernel vs gathered read by batch and context, GB/s")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--block", type=int, default=64, help="streamed tile width")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="bench-results")


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def one(batch: int, context: int, args, dtype, heads=32, kv_heads=8, dim=128, bs=16) -> dict:
    from nanoserve.attention.streamed import (
        streamed_decode,  # Triton: imported only once it is known to be there
    )

    per_row = context // bs
    blocks = batch * per_row + 1
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = (torch.randperm(blocks - 1, device="cuda")[: batch * per_row] + 1).view(batch, per_row)
    lens = torch.full((batch,), context, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
    scale = dim**-0.5
    row = {"batch": batch, "context": context}
    row["streamed_ms"] = timed(lambda: streamed_decode(q, k, v, table, lens, scale, args.block), args.repeats)
    try:
        row["gathered_ms"] = timed(lambda: gathered_decode(q, k, v, table, lens, scale), args.repeats)
        row["streamed_over_gathered"] = row["streamed_ms"] / row["gathered_ms"]
    except torch.OutOfMemoryError:
        row["gathered_ms"] = row["streamed_over_gathered"] = None  # the rectangle does not fit
    kv_bytes = 2 * batch * context * kv_heads * dim * k.element_size()
    row["streamed_gbs"] = kv_bytes / (row["streamed_ms"] / 1000) / 1e9
    return row


def check_can_run() -> None:
    """Both needs of the compiled kernel, named together: a CUDA device and Triton."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA device (none here; on the CPU, `nanoserve bench wire` compares the reads)")
    if not available("triton"):
        missing.append(f"Triton, which is not installed ({install_hint('triton')})")
    if missing:
        raise ConfigError("bench reads times the compiled Triton kernel and needs " + " and ".join(missing))


def main(args) -> int:
    check_can_run()
    dtype = getattr(torch, args.dtype)
    peak = copy_bandwidth() / 1e9
    rows = []
    for b in args.batches:
        for c in args.contexts:
            rows.append(one(b, c, args, dtype))
            torch.cuda.empty_cache()  # the pools of the last shape go before the next one's
    for row in rows:
        row["share_of_copy_bw"] = row["streamed_gbs"] / peak
    print_table(f"decode read on {torch.cuda.get_device_name(0)}, {args.dtype}, tile {args.block} "
                f"(copy bandwidth {peak:.0f} GB/s)", rows,
                ["batch", "context", "gathered_ms", "streamed_ms", "streamed_over_gathered", "streamed_gbs",
                 "share_of_copy_bw"])
    print(f"wrote {write_results(args.out, 'reads', {'copy_bandwidth_gbs': peak}, rows, args)}")
    return 0
