"""`nanoserve bench ab`: the A/B run (nanoserve/ab.py) from the command line, as a table and CSV/JSON."""

from __future__ import annotations

import dataclasses
import sys

from nanoserve.ab import DEFAULT_B, ab_requests, run_ab, show, snippet, variant
from nanoserve.bench.common import print_table, write_results
from nanoserve.config import EngineConfig
from nanoserve.flags import add_engine_flags, engine_flags
from nanoserve.workload import pick_prompts


def add_parser(sub) -> None:
    p = sub.add_parser("ab", help="two engines, two flag sets, the same requests: are the texts identical?")
    p.add_argument("--a", default="", metavar="FLAGS", help="engine A's overrides, e.g. 'max_num_seqs=4'")
    p.add_argument("--b", default=DEFAULT_B, metavar="FLAGS", help=f"engine B's overrides ({DEFAULT_B!r})")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=6, help="clients in flight at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sample-seed", type=int, default=1234, help="first sampled request's seed (+1 each)")
    p.add_argument("--out", default="bench-results")
    add_engine_flags(p)


def main(args) -> int:
    base = EngineConfig.from_flags(**engine_flags(args))
    config_a, config_b = variant(base, args.a), variant(base, args.b)
    bodies = ab_requests(pick_prompts(args.num_prompts), args.max_tokens, sampled_seed=args.sample_seed)
    phases = []

    def progress(phase, done, total):
        if phase not in phases:
            phases.append(phase)
            print(f"ab: {phase}", file=sys.stderr, flush=True)

    result = run_ab(config_a, config_b, bodies, args.concurrency, progress)
    if result.uncrowded:
        never = ", ".join(f"engine {s.name} never ran more than {s.peak_running} request(s) at once"
                          for s in result.uncrowded)
        print(f"refusing to report: {never} (wanted >= 2); raise --concurrency, --num-prompts or "
              "--max-tokens so requests overlap")
        return 3
    rows = [{"#": v.index, "kind": v.kind, "verdict": v.label, "A": snippet(v.text_a), "B": snippet(v.text_b)}
            for v in result.verdicts]
    print_table(f"A/B: A '{args.a}' vs B '{args.b}', {len(bodies)} requests, concurrency {args.concurrency}, "
                f"{args.max_tokens} tokens", rows, ["#", "kind", "verdict", "A", "B"])
    counters = [{"counter": name, "A": show(va, name), "B": show(vb, name)} for name, va, vb in result.counter_rows()]
    print_table("counters", counters, ["counter", "A", "B"])
    payload = {"summary": result.summary(), "all_identical": result.all_identical,
               "peak_running": {side.name: side.peak_running for side in result.sides},
               **dataclasses.asdict(result)}  # both sides' configs, /health before and after, every reply
    path = write_results(args.out, "ab", payload, [dataclasses.asdict(v) for v in result.verdicts], args)
    print(f"\n{result.summary()}\nwrote {path}")
    return 0 if result.all_identical else 1
