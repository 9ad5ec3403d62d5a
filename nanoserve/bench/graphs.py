"""`nanoserve bench graphs`: decode step time, eager vs CUDA-graph replay, by batch size (CUDA only).

One engine with the whole fast path on (`cuda_graphs`) serves every batch size: b requests are prefilled, then
decode steps are timed with replay and, on the same buffers and shapes, with the graphs set aside (eager),
alternating so drift lands on both. A step is the whole engine step (planning, forward, sampling), synchronized.
Also reported: capture time, graph pool memory, replay share, and batch-1 time against the HBM bound (weight and
KV bytes one step reads, over the copy bandwidth measured here).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from nanoserve.bench.common import print_table, write_results
from nanoserve.flags import add_engine_flags, engine_flags

# A real-sized random model (~0.75B parameters, SmolLM2's vocabulary so the default tokenizer serves it).
BIG = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=24,
           num_key_value_heads=8, max_position_embeddings=4096, vocab_size=49152, tie_word_embeddings=False)


def add_parser(sub) -> None:
    p = sub.add_parser("graphs", help="decode step time eager vs CUDA-graph replay by batch (CUDA only)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--random-big", action="store_true", help="a random-weight ~0.75B model instead of --model")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="--random-big's tokenizer, a Hugging Face directory (default: the default model's)")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def copy_bandwidth() -> float:
    """Bytes/s of a large device copy (read + write), the practical HBM ceiling."""
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - started)


def random_big_checkpoint(tokenizer: str | None) -> str:
    from nanoserve.bench.checkpoints import write_random_llama

    out = tempfile.mkdtemp(prefix="nanoserve-big-")
    write_random_llama(out, BIG, torch.bfloat16, tokenizer, device="cuda", feature="bench graphs --random-big")
    torch.cuda.empty_cache()
    return out


def time_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / steps


def one_batch(engine, b: int, args) -> dict:
    from nanoserve.sampling import SamplingParams

    total = 2 * args.rounds * args.steps + 8
    ids = [list(range(100 + i, 100 + i + args.prompt_len)) for i in range(b)]
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)) for p in ids]
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
        engine.step()
    captured = engine.runner.captured
    arms = {"captured": [], "eager": []}
    for _ in range(args.rounds):
        arms["captured"].append(time_steps(engine, args.steps))
        engine.runner.captured = None  # the same buffers and shapes, run eager
        arms["eager"].append(time_steps(engine, args.steps))
        engine.runner.captured = captured
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    eager, replay = statistics.median(arms["eager"]), statistics.median(arms["captured"])
    return {"batch": b, "eager_ms": eager, "captured_ms": replay, "speedup": eager / replay}


def main(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    if not torch.cuda.is_available():
        print("bench graphs needs a CUDA device (capture records CUDA graphs); run it on a GPU machine")
        return 2
    flags = {**engine_flags(args), "cuda_graphs": True, "max_num_seqs": max(args.batches)}
    if args.random_big:
        flags["model"] = random_big_checkpoint(args.tokenizer)
    flags["max_model_len"] = flags["max_model_len"] or 1024
    engine = Engine(EngineConfig.from_flags(**flags))
    rows = [one_batch(engine, b, args) for b in args.batches]
    capture = engine.stats().as_dict()["capture"]
    bw = copy_bandwidth()
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    mc, itemsize = engine.model_config, engine.runner.cache.k.element_size()
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize
    for row in rows:
        step_bytes = weights + row["batch"] * (args.prompt_len + args.rounds * args.steps) * kv_per_token
        row["hbm_bound_ms"] = step_bytes / bw * 1000
        row["captured_over_bound"] = row["captured_ms"] / row["hbm_bound_ms"]
    summary = {"model": engine.runner.loaded.name, "dtype": str(engine.runner.dtype), "shapes": capture["shapes"],
               "capture_seconds": capture["capture_seconds"], "pool_mib": capture["pool_bytes"] / 2**20,
               "replay_share": capture["replay_share"], "copy_bandwidth_gbs": bw / 1e9, "weight_mib": weights / 2**20}
    print_table(f"decode step, eager vs replay: {summary['model']} ({summary['dtype']}), prompt {args.prompt_len}",
                rows, ["batch", "eager_ms", "captured_ms", "speedup", "hbm_bound_ms", "captured_over_bound"])
    print_table("capture", [summary], list(summary))
    name = "graphs-big" if args.random_big else "graphs"
    print(f"wrote {write_results(args.out, name, {'summary': summary}, rows, args)}")
    return 0
