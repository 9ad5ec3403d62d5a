"""`nanoserve bench throughput`: a fixed mixed workload and a single stream, nanoserve vs its peers.

Every arm runs in one process on the same weights, device and threads: nanoserve as configured, the same engine
with batch invariance switched the other way (what determinism costs), its dense float32 self when the linears
are packed, transformers when installed (`nanoserve[hf]`; batched generate with left padding;
only the tokens each request asked for count as useful output), and llama.cpp on the same GGUF file when
llama-cpp-python is installed (`nanoserve[peers]`). Single-stream runs are interleaved across arms; the table
gives medians. Each arm's bound is the device's read bandwidth over the bytes of weights a token reads.
"""

from __future__ import annotations

import gc
import random
import re
import statistics
import time
from pathlib import Path

import torch

from nanoserve.bench.common import machine, memory_bandwidth_gbs, peak_rss_mib, print_table, write_results
from nanoserve.bench.peers import LlamaCppArm, llama_cpp_arm
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.optional import available, left_out
from nanoserve.parallel.group import memory_of

ONE_RANK = "nanoserve TP=1"
BACKEND_REDUCE = "nanoserve all-reduce over gloo"


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="mixed-workload and single-stream throughput vs transformers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="single-stream repeats (interleaved arms; median)")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers' generate batch size")
    p.add_argument("--skip-hf", action="store_true", help="leave out transformers' arm")
    p.add_argument("--skip-llama-cpp", action="store_true", help="leave out llama.cpp's arm")
    p.add_argument("--skip-eager-arm", action="store_true",
                   help="leave out the arm on eager torch ops where the fused CPU kernels run (what they buy)")
    p.add_argument("--skip-budget-arm", action="store_true",
                   help="leave out the arm with the step-time budget off (--max-step-ms 0): what smooth streams "
                        "cost this workload")
    p.add_argument("--skip-invariance-arm", action="store_true",
                   help="leave out the arm with batch invariance switched the other way (the cost of determinism)")
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
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=model.device)
        new = max(o for _, o in group)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
        useful += sum(o for _, o in group)
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": useful, "tok_s": useful / dt, "peak_running": batch}


def run_hf_single(model, prompt, n: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t
    return (n - 1) / max(total - first, 1e-9)


def model_path(engine) -> Path:
    """The checkpoint the engine loaded (a directory or a GGUF file), for the peers to load the same one."""
    from nanoserve.model.loader import default_model_path

    return Path(engine.config.model) if engine.config.model else default_model_path()


def load_hf(engine):
    """transformers' model on the same weights: its own GGUF loader, or the same HF directory."""
    from transformers import AutoModelForCausalLM

    path = model_path(engine)
    kwargs = {"dtype": engine.runner.dtype}
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.generation_config.eos_token_id = None
    return model.to(engine.runner.device).eval()  # beside nanoserve on its device: on a GPU machine, the GPU


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and weight buffer, less the embedding table
    (a lookup reads one row) unless it is the output head too, and less the rope tables."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    total -= model.rope.cos.nbytes + model.rope.sin.nbytes
    head = getattr(model.lm_head, "weight", None)
    if head is not model.embed_tokens.weight:
        total -= model.embed_tokens.weight.nbytes
    return total


LLAMA_CPP = "llama.cpp"


def _slug(arm: str) -> str:
    """'llama.cpp' -> 'llamacpp', 'nanoserve --no-batch-invariant' -> 'nanoserve_no_batch_invariant'."""
    return re.sub(r"[^a-z0-9]+", "_", arm.lower().replace(".", "")).strip("_")


def llama_cpp_for(args, engine, work) -> LlamaCppArm | None:
    """llama.cpp on the engine's own GGUF file, when the model is one and llama-cpp-python is installed."""
    longest = max(len(p) + n for p, n in work)
    return llama_cpp_arm(model_path(engine), torch.get_num_threads(),
                         n_ctx=max(longest, args.single_tokens + 64) + 16, skip=args.skip_llama_cpp)


def transformers_for(args, engine):
    """transformers on the same weights, unless skipped; without transformers the arm is left out, saying so."""
    if args.skip_hf:
        return None
    if not available("transformers"):
        print(left_out("transformers", "transformers"))
        return None
    return load_hf(engine)


EAGER = "nanoserve --no-fused-cpu-kernels"
BUDGET_OFF = "nanoserve --max-step-ms 0"


def invariance_arm(flags: dict) -> str:
    """The name of the arm that runs `flags` with batch invariance the other way."""
    return "nanoserve --no-batch-invariant" if flags["batch_invariant"] else "nanoserve --batch-invariant"


def build_arms(args, flags: dict) -> dict:
    """nanoserve as configured, then the engines it is measured against in this process: under tensor
    parallelism the same model on one rank (and over gloo when the ranks exchange through shared memory);
    otherwise the same engine with batch invariance switched (what determinism costs), with the step-time budget
    off (what smooth streams cost), on eager torch ops where it runs the fused CPU kernels (what they buy) and, on
    the 4-bit path, its dense float32 self."""
    from nanoserve import LLM

    arms = {"nanoserve": LLM(**flags)}
    engine = arms["nanoserve"].engine
    if flags["tensor_parallel_size"] > 1:  # the same engine on one rank with every thread, beside the group
        if engine.runner.parallel.group.shared is not None:  # exchanging through shared memory: and over gloo
            arms[BACKEND_REDUCE] = LLM(**{**flags, "tp_all_reduce": "backend"})
        arms[ONE_RANK] = LLM(**{**flags, "tensor_parallel_size": 1, "distributed_init": None})
    else:
        if not args.skip_invariance_arm:  # the same engine with batch invariance switched: what determinism costs
            arms[invariance_arm(flags)] = LLM(**{**flags, "batch_invariant": not flags["batch_invariant"]})
        if not args.skip_budget_arm and flags.get("max_step_ms") != 0:  # the token budget alone beside decodes
            arms[BUDGET_OFF] = LLM(**{**flags, "max_step_ms": 0})
        if not args.skip_eager_arm and engine.stats().features.get("fused", {}).get("active"):
            arms[EAGER] = LLM(**{**flags, "fused_cpu_kernels": False})  # the same engine on eager torch ops
        if "linear" in engine.stats().sections:  # the 4-bit path: its dense float32 self beside it
            arms["nanoserve dense"] = LLM(**{**flags, "quantization": "none"})
    return arms


def bandwidth_bounds(arms: dict, parallel: bool) -> tuple[float, dict[str, float]]:
    """The device's read bandwidth (GB/s) and, per arm, the tokens a second it allows a single stream."""
    engine = arms["nanoserve"].engine
    bandwidth = memory_bandwidth_gbs(mib=4096 if engine.runner.device.type == "cuda" else 512, device=engine.runner.device)
    bounds = {arm: bandwidth * 1e9 / decode_weight_bytes(llm.engine.runner.model) for arm, llm in arms.items()}
    if parallel:  # the ranks share this machine's memory: the whole model is read per token all the same
        for arm in ("nanoserve", BACKEND_REDUCE):
            if arm in bounds:
                bounds[arm] = bounds[ONE_RANK]
    return bandwidth, bounds


def run_single_rounds(args, arms: dict, hf, llama_cpp, prompt: list[int]) -> dict[str, list[float]]:
    """Single-stream tok/s of every arm, `args.repeats` times, the arms interleaved in each round so a noisy
    neighbour hits them alike; arms left out keep an empty list."""
    for llm in arms.values():
        run_nanoserve_single(llm, prompt, 8)  # warm-up
    single = {arm: [] for arm in (*arms, "transformers", LLAMA_CPP)}
    for _ in range(args.repeats):
        for arm, llm in arms.items():
            single[arm].append(run_nanoserve_single(llm, prompt, args.single_tokens))
        if hf is not None:
            single["transformers"].append(run_hf_single(hf, prompt, args.single_tokens))
        if llama_cpp is not None:
            single[LLAMA_CPP].append(llama_cpp.single(prompt, args.single_tokens))
    return single


def run_mixed_workload(args, arms: dict, hf, llama_cpp, work) -> tuple[dict[str, dict], float]:
    """The mixed workload through every arm, and the peak RSS (MiB) once the nanoserve arms alone have run."""
    mixed = {arm: run_nanoserve_mixed(llm, work) for arm, llm in arms.items()}
    rss_after_nanoserve = peak_rss_mib()
    if hf is not None:
        mixed["transformers"] = run_hf_mixed(hf, work, args.hf_batch, pad_id=0)
    if llama_cpp is not None:
        mixed[LLAMA_CPP] = llama_cpp.mixed(work)
    gc.collect()
    return mixed, rss_after_nanoserve


def table_rows(single: dict[str, list[float]], mixed: dict[str, dict], bounds: dict[str, float]) -> list[dict]:
    """One row per arm that ran the mixed workload, its single-stream median set against its bandwidth bound."""
    rows = []
    for arm in mixed:
        s = statistics.median(single[arm]) if single[arm] else None
        bound = bounds.get(arm, bounds.get("nanoserve dense", bounds["nanoserve"]))  # transformers: dense
        if arm == LLAMA_CPP:  # the same file's blocks as nanoserve's packed arm reads
            bound = bounds["nanoserve"]
        rows.append({
            "arm": arm,
            "mixed_tok_s": mixed[arm]["tok_s"],
            "mixed_seconds": mixed[arm]["seconds"],
            "output_tokens": mixed[arm]["output_tokens"],
            "rows_at_once": mixed[arm]["peak_running"],
            "single_tok_s": s,
            "single_share_of_bound": s / bound if s else None,
        })
    return rows


def print_throughput_table(args, engine, linear: dict | None, rows: list[dict]) -> None:
    print_table(
        f"throughput: {engine.runner.loaded.name}, {engine.runner.dtype}, linears {linear['format'] if linear else 'dense'}, "
        f"{torch.get_num_threads()} threads, {args.num_requests} requests, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}",
        rows, list(rows[0]),
    )


def arm_ratios(flags: dict, rows: list[dict], mixed: dict[str, dict]) -> dict[str, float]:
    """nanoserve's mixed and single-stream tok/s over each other arm's, for the arms that ran."""
    ratios = {}
    by_arm = {r["arm"]: r for r in rows}
    for other in (invariance_arm(flags), BUDGET_OFF, EAGER, "nanoserve dense", BACKEND_REDUCE, ONE_RANK, "transformers",
                  LLAMA_CPP):
        if other in by_arm:
            ratios[f"mixed_vs_{_slug(other)}"] = mixed["nanoserve"]["tok_s"] / mixed[other]["tok_s"]
            ratios[f"single_vs_{_slug(other)}"] = by_arm["nanoserve"]["single_tok_s"] / \
                by_arm[other]["single_tok_s"]
    return ratios


def print_findings(bandwidth: float, bounds: dict[str, float], linear: dict | None, ratios: dict[str, float]) -> None:
    """The machine, the bandwidth bounds, the packed linears' tallies and the ratios, under the table."""
    print(f"\nmachine: {machine()}")
    print(f"memory read bandwidth {bandwidth:.1f} GB/s; bandwidth bound per arm (tok/s): "
          + ", ".join(f"{arm} {b:.1f}" for arm, b in bounds.items()))
    if linear:
        form = linear["format"]
        print(f"{form} linears: {linear['modules']} modules, dense bf16 copy from rows {linear['dense_from_rows']}, "
              f"calls {form} {linear.get(f'{form}_calls', 0)} / dense {linear['dense_calls']}, head {linear['head']}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")


def print_parallel(section: dict | None, engine, arms: dict) -> None:
    """Under tensor parallelism: the ranks, what their collectives cost a step, and the weights each holds."""
    if section:
        steps = engine.stats().scheduler.steps
        print(f"tensor parallel: {section['world_size']} ranks over {section['backend']}, "
              f"{section['threads_per_rank']} threads each (one rank: {torch.get_num_threads()}); "
              f"{section['collectives']:,} collectives in {steps:,} steps, {section['collective_ms_per_step']:.2f} ms "
              "of each step in collectives on rank 0 ("
              + ", ".join(f"{kind} {ms:.2f}" for kind, ms in section["ms_per_step_by_kind"].items())
              + "); weights per rank "
              + ", ".join(f"{r['weights_bytes'] / 2**20:.0f} MiB" for r in section["ranks"])
              + f" (one rank: {memory_of(arms[ONE_RANK].engine.runner.model, arms[ONE_RANK].engine.runner.cache)['weights_bytes'] / 2**20:.0f} MiB)")


def main(args) -> int:
    flags = engine_flags(args)
    arms = build_arms(args, flags)
    engine = arms["nanoserve"].engine
    parallel = flags["tensor_parallel_size"] > 1
    work = workload(args.num_requests, args.prompt_len, args.output_len, engine.model_config.vocab_size)
    single_prompt = work[0][0][:64]
    bandwidth, bounds = bandwidth_bounds(arms, parallel)

    hf = transformers_for(args, arms.get("nanoserve dense", arms["nanoserve"]).engine)
    llama_cpp = llama_cpp_for(args, engine, work)
    single = run_single_rounds(args, arms, hf, llama_cpp, single_prompt)
    mixed, rss_after_nanoserve = run_mixed_workload(args, arms, hf, llama_cpp, work)

    rows = table_rows(single, mixed, bounds)
    linear = engine.stats().sections.get("linear")
    print_throughput_table(args, engine, linear, rows)
    ratios = arm_ratios(flags, rows, mixed)
    print_findings(bandwidth, bounds, linear, ratios)
    section = engine.stats().sections.get("parallel")
    print_parallel(section, engine, arms)
    print(f"peak RSS after nanoserve arms {rss_after_nanoserve:.0f} MiB; after all arms {peak_rss_mib():.0f} MiB; "
          f"KV pool {engine.runner.cache.nbytes / 2**20:.0f} MiB")
    path = write_results(args.out, "throughput", {
        "flags": flags, "bandwidth_gbs": bandwidth, "bound_tok_s": bounds, "single_runs": single, "mixed": mixed,
        "ratios": ratios, "linear": linear, "parallel": section, "peak_rss_mib": peak_rss_mib(),
        "llama_cpp_python": llama_cpp.version if llama_cpp is not None else None,
        "rss_after_nanoserve_mib": rss_after_nanoserve,
    }, rows, args)
    print(f"wrote {path}")
    return 0
