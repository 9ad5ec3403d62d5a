"""`nanoserve bench throughput`: a fixed mixed workload and a single stream, nanoserve vs transformers.

Both arms run in one process on the same weights, dtype and threads. transformers' arm is batched
generate with left padding; only the tokens each request asked for count as useful output.
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch

from nanoserve.bench.common import memory_bandwidth_gbs, peak_rss_mib, print_table, write_results
from nanoserve.flags import add_engine_flags, engine_flags


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="mixed-workload and single-stream throughput vs transformers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="single-stream repeats (interleaved arms; median)")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers' generate batch size")
    p.add_argument("--skip-hf", action="store_true", help="run nanoserve only")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def workload(n: int, prompt_len, output_len, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


def run_nanoserve_mixed(llm, work) -> dict:
    from nanoserve import SamplingParams

    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt,
            "peak_running": llm.engine.stats().scheduler.peak_running}


def run_nanoserve_single(llm, prompt, n) -> float:
    from nanoserve import SamplingParams

    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    first = out.metrics.first_token_time
    decode = time.monotonic() - first if first else time.perf_counter() - t
    return (len(out.outputs[0].token_ids) - 1) / decode


def run_hf_mixed(model, work, batch: int, pad_id: int) -> dict:
    ordered = sorted(work, key=lambda w: len(w[0]))
    t = time.perf_counter()
    useful = 0
    for i in range(0, len(ordered), batch):
        group = ordered[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        new = max(o for _, o in group)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
        useful += sum(o for _, o in group)
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": useful, "tok_s": useful / dt, "peak_running": batch}


def run_hf_single(model, prompt, n: int) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t
    return (n - 1) / max(total - first, 1e-9)


def load_hf(engine):
    """transformers' model on the same weights: its own GGUF loader, or the same HF directory."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from nanoserve.model.loader import default_model_path

    path = Path(engine.config.model) if engine.config.model else default_model_path()
    kwargs = {"dtype": engine.dtype}
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.generation_config.eos_token_id = None
    return model.eval()


def main(args) -> int:
    from nanoserve import LLM

    flags = engine_flags(args)
    llm = LLM(**flags)
    engine = llm.engine
    cfg = engine.model_config
    work = workload(args.num_requests, args.prompt_len, args.output_len, cfg.vocab_size)
    single_prompt = work[0][0][:64]
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if not cfg.tie_word_embeddings:
        weight_bytes -= engine.model.embed_tokens.weight.nbytes  # an embedding lookup reads one row
    bandwidth = memory_bandwidth_gbs(mib=512)
    bound = bandwidth * 1e9 / weight_bytes

    hf = None if args.skip_hf else load_hf(engine)
    run_nanoserve_single(llm, single_prompt, 8)  # warm-up
    single = {"nanoserve": [], "transformers": []}
    for _ in range(args.repeats):
        single["nanoserve"].append(run_nanoserve_single(llm, single_prompt, args.single_tokens))
        if hf is not None:
            single["transformers"].append(run_hf_single(hf, single_prompt, args.single_tokens))
    mixed = {"nanoserve": run_nanoserve_mixed(llm, work)}
    rss_after_nanoserve = peak_rss_mib()
    if hf is not None:
        mixed["transformers"] = run_hf_mixed(hf, work, args.hf_batch, pad_id=0)
    gc.collect()

    rows = []
    for arm in mixed:
        s = statistics.median(single[arm]) if single[arm] else None
        rows.append({
            "arm": arm,
            "mixed_tok_s": mixed[arm]["tok_s"],
            "mixed_seconds": mixed[arm]["seconds"],
            "output_tokens": mixed[arm]["output_tokens"],
            "rows_at_once": mixed[arm]["peak_running"],
            "single_tok_s": s,
            "single_share_of_bound": s / bound if s else None,
        })
    print_table(
        f"throughput: {engine.loaded.name}, {engine.dtype}, {torch.get_num_threads()} threads, "
        f"{args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"outputs {args.output_len[0]}-{args.output_len[1]}",
        rows, list(rows[0]),
    )
    ratios = {}
    if hf is not None:
        ratios = {
            "mixed_ratio": mixed["nanoserve"]["tok_s"] / mixed["transformers"]["tok_s"],
            "single_ratio": rows[0]["single_tok_s"] / rows[1]["single_tok_s"],
        }
    print(f"\nmemory read bandwidth {bandwidth:.1f} GB/s; weights read per decode step {weight_bytes / 2**20:.0f} MiB; "
          f"bandwidth bound {bound:.1f} tok/s")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"peak RSS after nanoserve arms {rss_after_nanoserve:.0f} MiB; after all arms {peak_rss_mib():.0f} MiB; "
          f"KV pool {engine.cache.nbytes / 2**20:.0f} MiB")
    path = write_results(args.out, "throughput", {
        "flags": flags, "bandwidth_gbs": bandwidth, "weight_bytes_per_step": weight_bytes, "bound_tok_s": bound,
        "single_runs": single, "mixed": mixed, "ratios": ratios, "peak_rss_mib": peak_rss_mib(),
        "rss_after_nanoserve_mib": rss_after_nanoserve,
    }, rows, args)
    print(f"wrote {path}")
    return 0
