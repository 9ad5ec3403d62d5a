"""`nanoserve bench throughput`: a fixed mixed workload and a single stream, nanoserve vs its peers.

Every arm runs in one process on the same weights, device and threads: nanoserve as configured, the same engine
with batch invariance switched the other way (what determinism costs), its dense float32 self when the linears
are packed, transformers when installed (`nanoserve[hf]`; batched generate with left padding;
only the tokens each request asked for count as useful output), and llama.cpp on the same GGUF file when
llama-cpp-python is installed (`nanoserve[peers]`). The arms run one at a time, each loaded, measured and
freed before the next, so the run holds one model and one KV pool at a time (all of them at once came to
several times the engine's own memory); each arm's peak resident memory is in the table. The table gives the
median of each arm's single-stream runs. Each arm's bound is the device's read bandwidth over the bytes of
weights a token reads.
"""

from __future__ import annotations

import gc
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve.bench.common import machine, memory_bandwidth_gbs, peak_rss_mib, print_table, write_results
from nanoserve.bench.memory import PeakRss, trimmed_resident_mib
from nanoserve.bench.peers import LlamaCppArm, llama_cpp_runs
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
    p.add_argument("--repeats", type=int, default=3, help="single-stream runs per arm (the table gives the median)")
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


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model on the same weights: its own GGUF loader, or the same HF directory."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    model.generation_config.eos_token_id = None
    return model.to(device).eval()  # on nanoserve's device: on a GPU machine, the GPU


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


class NanoserveArm:
    """An engine of `flags` as an arm; what the report needs of it is read off while it lives (`facts`)."""

    def __init__(self, flags: dict):
        from nanoserve import LLM

        self.llm = LLM(**flags)
        self.engine = self.llm.engine

    def single(self, prompt, n) -> float:
        return run_nanoserve_single(self.llm, prompt, n)

    def mixed(self, work) -> dict:
        return run_nanoserve_mixed(self.llm, work)

    def facts(self) -> dict:
        engine = self.engine
        stats = engine.stats()
        return {"weight_bytes": decode_weight_bytes(engine.runner.model), "model": engine.runner.loaded.name,
                "dtype": engine.runner.dtype, "device": engine.runner.device, "path": model_path(engine),
                "linear": stats.sections.get("linear"), "parallel": stats.sections.get("parallel"),
                "fused": bool(stats.features.get("fused", {}).get("active")), "steps": stats.scheduler.steps,
                "kv_pool_bytes": engine.runner.cache.nbytes,
                "weights_bytes": memory_of(engine.runner.model, engine.runner.cache)["weights_bytes"],
                "shared_exchange": engine.runner.parallel.group.shared is not None
                if engine.config.tensor_parallel_size > 1 else False}

    def close(self) -> None:
        self.engine.close()


class TransformersArm:
    def __init__(self, path: Path, dtype, device, batch: int):
        self.model, self.batch = load_hf(path, dtype, device), batch

    def single(self, prompt, n) -> float:
        return run_hf_single(self.model, prompt, n)

    def mixed(self, work) -> dict:
        return run_hf_mixed(self.model, work, self.batch, pad_id=0)

    def close(self) -> None:
        self.model = None


@dataclass
class ArmResult:
    single: list[float]
    mixed: dict
    peak_rss_mib: float
    facts: dict = field(default_factory=dict)


def run_arm(name: str, args, load, plan) -> ArmResult:
    """Load an arm, time `args.repeats` single streams after a warm-up and the mixed workload (`plan(arm)`
    gives the workload and the single stream's prompt), and free the arm before returning, its peak resident
    memory (loading included) sampled throughout. A line says so as each arm finishes."""
    with PeakRss() as peak:
        arm = load()
        try:
            work, prompt = plan(arm)
            arm.single(prompt, 8)  # warm-up
            single = [arm.single(prompt, args.single_tokens) for _ in range(args.repeats)]
            mixed = arm.mixed(work)
            facts = getattr(arm, "facts", dict)()
        finally:
            arm.close()
            del arm
            gc.collect()
    trimmed_resident_mib()  # glibc hands the freed arm back to the system before the next one loads
    print(f"{name}: mixed {mixed['tok_s']:.1f} tok/s, single stream {statistics.median(single):.1f} tok/s, "
          f"peak RSS {peak.mib:,.0f} MiB", flush=True)
    return ArmResult(single, mixed, peak.mib, facts)


EAGER = "nanoserve --no-fused-cpu-kernels"
BUDGET_OFF = "nanoserve --max-step-ms 0"


def invariance_arm(flags: dict) -> str:
    """The name of the arm that runs `flags` with batch invariance the other way."""
    return "nanoserve --no-batch-invariant" if flags["batch_invariant"] else "nanoserve --batch-invariant"


def other_arms(args, flags: dict, main: dict) -> dict[str, dict]:
    """The engines nanoserve (whose facts are `main`) is measured against, by name, as flags: under tensor
    parallelism the same model on one rank (and over gloo when the ranks exchange through shared memory);
    otherwise the same engine with batch invariance switched (what determinism costs), with the step-time budget
    off (what smooth streams cost), on eager torch ops where it runs the fused CPU kernels (what they buy) and, on
    the 4-bit path, its dense float32 self."""
    arms = {}
    if flags["tensor_parallel_size"] > 1:  # the same engine on one rank with every thread, beside the group
        if main["shared_exchange"]:  # exchanging through shared memory: and over gloo
            arms[BACKEND_REDUCE] = {**flags, "tp_all_reduce": "backend"}
        arms[ONE_RANK] = {**flags, "tensor_parallel_size": 1, "distributed_init": None}
        return arms
    if not args.skip_invariance_arm:
        arms[invariance_arm(flags)] = {**flags, "batch_invariant": not flags["batch_invariant"]}
    if not args.skip_budget_arm and flags.get("max_step_ms") != 0:  # the token budget alone beside decodes
        arms[BUDGET_OFF] = {**flags, "max_step_ms": 0}
    if not args.skip_eager_arm and main["fused"]:
        arms[EAGER] = {**flags, "fused_cpu_kernels": False}
    if main["linear"]:  # the 4-bit path: its dense float32 self beside it
        arms["nanoserve dense"] = {**flags, "quantization": "none"}
    return arms


def run_all_arms(args, flags: dict) -> dict[str, ArmResult]:
    """nanoserve first (its vocabulary makes the workload), then each other arm in turn: one model in memory
    at a time."""
    made = []

    def make_workload(arm: NanoserveArm):
        made.append(workload(args.num_requests, args.prompt_len, args.output_len, arm.engine.model_config.vocab_size))
        return made[0], made[0][0][0][:64]

    results = {"nanoserve": run_arm("nanoserve", args, lambda: NanoserveArm(flags), make_workload)}
    work, main = made[0], results["nanoserve"].facts
    same = lambda arm: (work, work[0][0][:64])  # noqa: E731
    for name, arm_flags in other_arms(args, flags, main).items():
        results[name] = run_arm(name, args, lambda f=arm_flags: NanoserveArm(f), same)
    dense = results.get("nanoserve dense", results["nanoserve"]).facts
    if transformers_runs(args):
        results["transformers"] = run_arm(
            "transformers", args, lambda: TransformersArm(main["path"], dense["dtype"], main["device"], args.hf_batch), same)
    if llama_cpp_runs(main["path"], args.skip_llama_cpp):
        longest = max(len(p) + n for p, n in work)
        results[LLAMA_CPP] = run_arm(LLAMA_CPP, args, lambda: LlamaCppArm(main["path"], torch.get_num_threads(),
                                                               n_ctx=max(longest, args.single_tokens + 64) + 16),
                                     same)
    return results


def transformers_runs(args) -> bool:
    """transformers' arm runs unless skipped; without transformers it is left out, saying so."""
    if args.skip_hf:
        return False
    if not available("transformers"):
        print(left_out("transformers", "transformers"))
        return False
    return True


def bandwidth_bounds(bandwidth: float, results: dict[str, ArmResult], parallel: bool) -> dict[str, float]:
    """Per arm, the tokens a second the device's read bandwidth (GB/s) allows a single stream."""
    bounds = {arm: bandwidth * 1e9 / r.facts["weight_bytes"] for arm, r in results.items()
              if "weight_bytes" in r.facts}
    if parallel:  # the ranks share this machine's memory: the whole model is read per token all the same
        for arm in ("nanoserve", BACKEND_REDUCE):
            if arm in bounds:
                bounds[arm] = bounds[ONE_RANK]
    return bounds


def table_rows(results: dict[str, ArmResult], bounds: dict[str, float]) -> list[dict]:
    """One row per arm, its single-stream median set against its bandwidth bound, and its peak memory."""
    rows = []
    for arm, r in results.items():
        s = statistics.median(r.single) if r.single else None
        bound = bounds.get(arm, bounds.get("nanoserve dense", bounds["nanoserve"]))  # transformers: dense
        if arm == LLAMA_CPP:  # the same file's blocks as nanoserve's packed arm reads
            bound = bounds["nanoserve"]
        rows.append({
            "arm": arm,
            "mixed_tok_s": r.mixed["tok_s"],
            "mixed_seconds": r.mixed["seconds"],
            "output_tokens": r.mixed["output_tokens"],
            "rows_at_once": r.mixed["peak_running"],
            "single_tok_s": s,
            "single_share_of_bound": s / bound if s else None,
            "peak_rss_mib": r.peak_rss_mib,
        })
    return rows


def print_throughput_table(args, main: dict, rows: list[dict]) -> None:
    linear = main["linear"]
    print_table(
        f"throughput: {main['model']}, {main['dtype']}, linears {linear['format'] if linear else 'dense'}, "
        f"{torch.get_num_threads()} threads, {args.num_requests} requests, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}",
        rows, list(rows[0]),
    )


def arm_ratios(flags: dict, rows: list[dict]) -> dict[str, float]:
    """nanoserve's mixed and single-stream tok/s over each other arm's, for the arms that ran."""
    ratios = {}
    by_arm = {r["arm"]: r for r in rows}
    for other in (invariance_arm(flags), BUDGET_OFF, EAGER, "nanoserve dense", BACKEND_REDUCE, ONE_RANK, "transformers",
                  LLAMA_CPP):
        if other in by_arm:
            ratios[f"mixed_vs_{_slug(other)}"] = by_arm["nanoserve"]["mixed_tok_s"] / by_arm[other]["mixed_tok_s"]
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


def print_parallel(main: dict, results: dict[str, ArmResult]) -> None:
    """Under tensor parallelism: the ranks, what their collectives cost a step, and the weights each holds."""
    section = main["parallel"]
    if section:
        print(f"tensor parallel: {section['world_size']} ranks over {section['backend']}, "
              f"{section['threads_per_rank']} threads each (one rank: {torch.get_num_threads()}); "
              f"{section['collectives']:,} collectives in {main['steps']:,} steps, "
              f"{section['collective_ms_per_step']:.2f} ms of each step in collectives on rank 0 ("
              + ", ".join(f"{kind} {ms:.2f}" for kind, ms in section["ms_per_step_by_kind"].items())
              + "); weights per rank "
              + ", ".join(f"{r['weights_bytes'] / 2**20:.0f} MiB" for r in section["ranks"])
              + f" (one rank: {results[ONE_RANK].facts['weights_bytes'] / 2**20:.0f} MiB)")


def main(args) -> int:
    flags = engine_flags(args)
    parallel = flags["tensor_parallel_size"] > 1
    bandwidth = memory_bandwidth_gbs(mib=512, device="cpu")  # before any arm: its buffer is not theirs
    results = run_all_arms(args, flags)
    first = results["nanoserve"].facts
    if first["device"].type == "cuda":  # the device's own bandwidth bounds a GPU's arms
        bandwidth = memory_bandwidth_gbs(mib=4096, device=first["device"])
    bounds = bandwidth_bounds(bandwidth, results, parallel)
    rows = table_rows(results, bounds)
    print_throughput_table(args, first, rows)
    ratios = arm_ratios(flags, rows)
    print_findings(bandwidth, bounds, first["linear"], ratios)
    print_parallel(first, results)
    peak = peak_rss_mib()
    engine_rss = results["nanoserve"].peak_rss_mib
    print(f"peak RSS of the run {peak:.0f} MiB, {peak / engine_rss:.2f}x the nanoserve arm's {engine_rss:.0f} MiB "
          f"(the arms run one at a time); KV pool {first['kv_pool_bytes'] / 2**20:.0f} MiB")
    llama_cpp = results.get(LLAMA_CPP)
    path = write_results(args.out, "throughput", {
        "flags": flags, "bandwidth_gbs": bandwidth, "bound_tok_s": bounds,
        "single_runs": {arm: r.single for arm, r in results.items()},
        "mixed": {arm: r.mixed for arm, r in results.items()},
        "ratios": ratios, "linear": first["linear"], "parallel": first["parallel"], "peak_rss_mib": peak,
        "peak_rss_mib_by_arm": {arm: r.peak_rss_mib for arm, r in results.items()},
        "peak_rss_over_engine": peak / engine_rss,
        "llama_cpp_python": llama_cpp.facts["version"] if llama_cpp is not None else None,
    }, rows, args)
    print(f"wrote {path}")
    return 0
