"""`nanoserve bench sizes`: the files people actually run, nanoserve beside llama.cpp on each, in one run.

For each shape (Llama-3.2-1B, 3B, Llama-3.1-8B: random weights, the default model's tokenizer) an F16 GGUF file
is written and quantized by llama.cpp's own quantizer to each type asked (Q4_0, Q4_K_M, ...); then, round after
round, each engine loads the file in a fresh process and is timed (nanoserve/bench/sizes_arms.py), the engines'
order alternating between rounds so drift lands on both. The table gives medians and nanoserve / llama.cpp
ratios: load seconds, resident memory after load and after the first decode (and over the file's size plus the
KV pool), single-stream decode, prefill of one prompt, and the total tok/s of concurrent streams (llama.cpp's as llama-server's slots decode them: one batch a
step over every sequence, nanoserve/bench/llama_cpp_slots.py).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from nanoserve.bench.common import print_table, write_results
from nanoserve.bench.gguf_files import SHAPES, quantize, write_random_gguf
from nanoserve.optional import require

# resident memory after the load, after the first decode (every weight read once: a mapped file's pages count from
# then on), and at its peak
RSS_MEASURES = ("rss_after_load_mib", "rss_after_decode_mib", "peak_rss_mib")
# huge_pages_s: nanoserve's packed weights on huge pages (a background move after the load; the speeds are measured
# after it), from the load's start
MEASURES = ("load_s", "huge_pages_s", "kv_pool_mib", *RSS_MEASURES, "decode_tok_s", "prefill_tok_s")


def add_parser(sub) -> None:
    p = sub.add_parser("sizes", help="random-weight GGUF files of real shapes (1B-8B), quantized by llama.cpp: "
                                     "load, memory, decode, prefill vs llama.cpp on the same file")
    p.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"], choices=sorted(SHAPES))
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"],
                   help="llama.cpp quantization types (LLAMA_FTYPE_MOSTLY_* names)")
    p.add_argument("--rounds", type=int, default=3, help="loads of each engine per file (medians)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512, help="the prefill prompt (llama-bench's pp512)")
    p.add_argument("--streams", type=int, nargs="*", default=[8, 32], help="concurrent streams (llama.cpp: that many slots)")
    p.add_argument("--batch-tokens", type=int, default=64, help="tokens each concurrent stream generates")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="nanoserve's KV pool; default: what the largest workload holds (the prefill prompt and its "
                        "decode, or every concurrent stream's 16-token prompt and its tokens), in float32")
    p.add_argument("--files", default="bench-files", help="where the GGUF files are written (and reused)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="nanoserve alone (the files still need "
                                                                   "llama-cpp-python's quantizer)")
    p.add_argument("--out", default="bench-results")


def gguf_file(files: Path, shape: str, type_name: str, threads: int) -> Path:
    """The quantized file of `shape` in `type_name`, written (and its F16 source) unless already there."""
    out = files / f"{shape}-{type_name}.gguf"
    if out.exists():
        return out
    source = files / f"{shape}-F16.gguf"
    if not source.exists():
        print(f"writing {source} (random weights)", flush=True)
        write_random_gguf(source.with_suffix(".part"), shape).rename(source)
    print(f"quantizing to {type_name} with llama.cpp", flush=True)
    quantize(source, out.with_suffix(".part"), type_name, threads).rename(out)
    return out


def run_arm(engine: str, path: Path, args) -> dict:
    """One load and its measures, in a fresh process (its memory and cold load are its own)."""
    spec = {"engine": engine, "path": str(path), "threads": args.threads, "decode_tokens": args.decode_tokens,
            "prompt_tokens": args.prompt_tokens, "streams": args.streams, "batch_tokens": args.batch_tokens,
            "kv_cache_gib": args.kv_cache_gib, "seed": 0}
    done = subprocess.run([sys.executable, "-m", "nanoserve.bench.sizes_arms", json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{engine} on {path.name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _medians(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def measure_file(path: Path, engines: list[str], args) -> dict[str, dict]:
    """Each engine's medians over `args.rounds` rounds, the engines' order alternating round by round."""
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            runs[engine].append(run_arm(engine, path, args))
            print(f"  round {r + 1} {engine}: " + ", ".join(f"{k} {v:,.1f}" for k, v in runs[engine][-1].items()
                                                              if isinstance(v, float)), flush=True)
    return {e: {**_medians(rs), "rounds": len(rs), **{k: v for k, v in rs[0].items() if isinstance(v, str)}}
            for e, rs in runs.items()}


def _over_budget(engine: dict, key: str, file_mib: float) -> float | None:
    """Resident memory over what it must hold: the file plus the engine's own KV pool (1.0 is the floor)."""
    if key not in RSS_MEASURES or key not in engine:
        return None
    return engine[key] / (file_mib + engine.get("kv_pool_mib", 0.0))


def rows_for(shape: str, type_name: str, path: Path, medians: dict[str, dict], streams: list[int]) -> list[dict]:
    """One row per measure: nanoserve, llama.cpp, and their ratio; for resident memory also each engine's over
    the file plus its KV pool."""
    ours, theirs = medians["nanoserve"], medians.get("llama.cpp", {})
    file_mib = path.stat().st_size / 2**20
    rows = []
    for key in (*MEASURES, *(f"streams_{n}_tok_s" for n in streams)):
        a, b = ours.get(key), theirs.get(key)
        rows.append({"file": f"{shape} {type_name}", "file_mib": round(file_mib), "measure": key, "nanoserve": a,
                     "llama.cpp": b, "ratio": a / b if a and b else None,
                     "nanoserve_over_file_kv": _over_budget(ours, key, file_mib),
                     "llama.cpp_over_file_kv": _over_budget(theirs, key, file_mib)})
    return rows


def main(args) -> int:
    require("llama_cpp", "nanoserve bench sizes (llama.cpp's quantizer writes its files)")
    engines = ["nanoserve"] if args.skip_llama_cpp else ["nanoserve", "llama.cpp"]
    files = Path(args.files)
    rows, results = [], {}
    for shape in args.shapes:
        for type_name in args.types:
            path = gguf_file(files, shape, type_name, args.threads)
            print(f"{path.name}: {path.stat().st_size / 2**20:,.0f} MiB", flush=True)
            medians = measure_file(path, engines, args)
            results[path.name] = medians
            rows += rows_for(shape, type_name, path, medians, args.streams)
    columns = ["file", "file_mib", "measure", "nanoserve", "llama.cpp", "ratio", "nanoserve_over_file_kv",
               "llama.cpp_over_file_kv"]
    print_table(f"nanoserve vs llama.cpp, same files ({args.threads} threads; medians of {args.rounds} rounds, "
                "each a fresh process; ratio = nanoserve / llama.cpp)", rows, columns)
    path = write_results(args.out, "sizes", {"results": results}, rows, args)
    print(f"\nwrote {path}")
    return 0
