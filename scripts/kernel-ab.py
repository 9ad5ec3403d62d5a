#!/usr/bin/env python3
"""Two versions of the packed kernels, A/B in one process: the kernel figures BENCHMARKS.md quotes as "A/B".

Each side is a git revision (or `.` for the working tree): its `nanoserve/kernels` sources are compiled with this
checkout's build flags into a library of its own, both libraries are loaded side by side, and each case (kernel,
type, activation rows) calls them in turn, the order alternating every round, on the same packed weight and
input. Medians over the rounds; B/A > 1 means B is faster. In one process, both sides see the same clock, cache
and neighbours, which separate runs on a 2-core machine do not.

    python scripts/kernel-ab.py HEAD~1 HEAD [--rows 1 8 64] [--types Q4_K Q5_K Q6_K Q4_0] [--rounds 15]
        [--threads 2] [--stream MIB] [--layouts] [--json out.json]

Types: Q4_K, Q5_K and Q6_K run on kx16 (rows interleaved 16 outputs a super-block), Q4_0 on q4x8. The weight is
8192 x 2048 random blocks with finite f16 scales (as `scripts/kquant-speed.py` makes them). The two sides must
pack the weight to the same bytes (the script says so and stops otherwise), unless `--layouts`: then a layout
change is what is compared, each side calling its own packing of the same file rows, their outputs still required
to agree bit for bit, and each side's GB/s counted from its own packed bytes.
The weight fits a large last-level cache; `--stream MIB` gives each side copies of it filling MIB and each call
the next copy, so every call reads its weight from memory, as a model's decode step does (GB/s reported).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KX16_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


def _kquant_speed():
    """scripts/kquant-speed.py's weight maker (a file name with a dash: loaded by path)."""
    spec = importlib.util.spec_from_file_location("kquant_speed", ROOT / "scripts" / "kquant-speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_sources(revision: str, into: Path) -> Path:
    """`nanoserve/kernels` at `revision` (or the working tree for '.') copied under `into`."""
    if revision == ".":
        return ROOT / "nanoserve" / "kernels"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "nanoserve/kernels"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "nanoserve" / "kernels"


def compile_library(sources: Path, out: Path) -> ctypes.CDLL:
    """Every C source of one revision's kernels, built with this checkout's flags, as one library."""
    from nanoserve.kernels import build

    names = sorted(str(p) for p in sources.glob("*.c"))
    subprocess.run(["cc", *build.compile_flags(), *names, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.ns_kx16_matmul.argtypes = [i32, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i32, i32]
    lib.ns_kx16_pack.argtypes = [i32, ptr, i64, i64, ptr, i32]
    lib.ns_kx16_packed_bytes.argtypes = [i32, i64, i64]
    lib.ns_kx16_packed_bytes.restype = i64
    lib.ns_q4x8_matmul.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i32, i32]
    lib.ns_q4x8_pack_gguf.argtypes = [ptr, i64, i64, ptr, i32]
    lib.ns_q4x8_packed_bytes.argtypes = [i64, i64]
    lib.ns_q4x8_packed_bytes.restype = i64
    return lib


def packed_weight(lib, type_name: str, raw: torch.Tensor, out: int, k: int, threads: int) -> torch.Tensor:
    if type_name == "Q4_0":
        packed = torch.empty(lib.ns_q4x8_packed_bytes(out, k), dtype=torch.uint8)
        lib.ns_q4x8_pack_gguf(raw.data_ptr(), out, k, packed.data_ptr(), threads)
    else:
        t = KX16_TYPES[type_name]
        packed = torch.empty(lib.ns_kx16_packed_bytes(t, out, k), dtype=torch.uint8)
        lib.ns_kx16_pack(t, raw.data_ptr(), out, k, packed.data_ptr(), threads)
    return packed


def caller(lib, type_name: str, copies: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, threads: int):
    """A call of the kernel on the next of `copies` (one copy: the same weight every call)."""
    rows, k = x.shape
    out, turn = y.shape[1], [0]

    def call():
        packed = copies[turn[0] % len(copies)]
        turn[0] += 1
        if type_name == "Q4_0":
            return lib.ns_q4x8_matmul(packed.data_ptr(), x.data_ptr(), rows, k, out, None, y.data_ptr(), threads, 0)
        return lib.ns_kx16_matmul(KX16_TYPES[type_name], packed.data_ptr(), x.data_ptr(), rows, k, out, out, None,
                                  y.data_ptr(), threads, 0)
    return call


def seconds(call, repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def build_cases(libs: dict, args, out: int, k: int) -> list[dict]:
    weights = _kquant_speed()
    cases = []
    for type_name in args.types:
        raw = weights.weight("Q4_0/q4x8" if type_name == "Q4_0" else type_name, out, k)
        packed = {side: packed_weight(lib, type_name, raw, out, k, args.threads) for side, lib in libs.items()}
        if not args.layouts and not torch.equal(packed["A"], packed["B"]):
            raise SystemExit(f"kernel-ab: A and B pack {type_name} differently (a layout change: --layouts)")
        count = {side: max(1, -(-args.stream * 2**20 // packed[side].numel())) if args.stream else 1 for side in libs}
        copies = {side: [packed[side]] + [packed[side].clone() for _ in range(count[side] - 1)] for side in libs}
        for rows in args.rows:
            x, y = torch.randn(rows, k), {side: torch.empty(rows, out) for side in libs}
            calls = {side: caller(lib, type_name, copies[side], x, y[side], args.threads) for side, lib in libs.items()}
            calls["A"](), calls["B"]()
            if not torch.equal(y["A"], y["B"]):
                if args.layouts:
                    raise SystemExit(f"kernel-ab: A's and B's packings give different bits for {type_name} at {rows} "
                                     "rows: a layout change must not change a value")
                print(f"kernel-ab: note: A and B give different bits for {type_name} at {rows} rows", file=sys.stderr)
            cases.append({"type": type_name, "rows": rows, "calls": calls, "seconds": {"A": [], "B": []},
                          "bytes": {side: packed[side].numel() for side in libs}})
    return cases


def run_rounds(cases: list[dict], rounds: int, streaming: bool) -> None:
    for round_ in range(rounds):
        for case in cases:
            for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                repeats = 10 if case["rows"] == 1 else 3
                case["seconds"][side].append(seconds(case["calls"][side], repeats * (4 if streaming else 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="git revision of side A, or . for the working tree")
    parser.add_argument("b", help="git revision of side B, or . for the working tree")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--types", nargs="+", default=[*KX16_TYPES, "Q4_0"], choices=[*KX16_TYPES, "Q4_0"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream", type=int, default=0, metavar="MIB",
                        help="cycle through copies of the weight filling MIB a side (read from memory)")
    parser.add_argument("--layouts", action="store_true",
                        help="A and B may pack differently (a layout change); their outputs must still agree")
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    out, k = 8192, 2048
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as work:
        work = Path(work)
        libs = {side: compile_library(kernel_sources(rev, work / side), work / f"{side}.so")
                for side, rev in (("A", args.a), ("B", args.b))}
        cases = build_cases(libs, args, out, k)
        run_rounds(cases, args.rounds, bool(args.stream))
    rows_out = []
    print(f"A = {args.a}, B = {args.b}; {args.threads} threads, medians of {args.rounds} alternated rounds")
    print(f"{'type':>5} {'rows':>4} {'A GFLOP/s':>10} {'B GFLOP/s':>10} {'A GB/s':>7} {'B GB/s':>7} {'B/A':>6}")
    for case in cases:
        a, b = (statistics.median(case["seconds"][s]) for s in ("A", "B"))
        flop = 2 * case["rows"] * out * k
        rows_out.append({"type": case["type"], "rows": case["rows"], "a_gflop_s": flop / a / 1e9,
                         "b_gflop_s": flop / b / 1e9, "a_weight_gb_s": case["bytes"]["A"] / a / 1e9,
                         "b_weight_gb_s": case["bytes"]["B"] / b / 1e9, "b_over_a": a / b})
        r = rows_out[-1]
        print(f"{r['type']:>5} {r['rows']:>4} {r['a_gflop_s']:>10.1f} {r['b_gflop_s']:>10.1f} "
              f"{r['a_weight_gb_s']:>7.1f} {r['b_weight_gb_s']:>7.1f} {r['b_over_a']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "threads": args.threads, "rounds": args.rounds, "stream_mib": args.stream,
                       "layouts": args.layouts,
                       "shape": [out, k], "results": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
