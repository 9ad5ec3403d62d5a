"""Two commits of nanoserve, the same workload, interleaved round by round: is a refactor within noise?

    python scripts/compare-commits.py OLD_REV NEW_REV [--rounds 7] [--model FILE.gguf] [--out bench-results]

Each revision is unpacked (git archive) into its own directory and served by a worker process that imports
nanoserve from there and loads the default model once; the workers then take turns (old, new, new, old, ...) on
the same workload, so drift on a shared machine lands on both. `--model` serves a file of your own instead (a
`nanoserve bench sizes` file, say; each worker waits for its packed weights' move onto huge pages first). Two
workloads, as `nanoserve bench throughput` has them: one stream (decode tok/s) and a crowd of 8 prompts (generated
tok/s). Prints the medians and the new/old ratios, and writes compare-commits.{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import json, sys, time
from nanoserve import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else None
llm = LLM() if model is None else LLM(model=model, max_model_len=512, kv_cache_gib=0.5)
moved = getattr(getattr(llm.engine.runner, "loaded", None), "fused", None)
if getattr(moved, "huge_pages", None) is not None:
    moved.huge_pages.done.wait()  # the steady state (kernels/pages.py), in revisions that have it
greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
crowd = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
prompts = ["Explain photosynthesis to a ten-year-old.", "Write a haiku about the sea.",
           "Give me three tips for a job interview.", "What is the capital of France?",
           "Summarise the plot of Romeo and Juliet.", "How do I boil an egg?",
           "Translate good morning into Spanish.", "What is a tuple in Python?"]
llm.generate(prompts[:2], crowd, use_tqdm=False)  # warm
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    started = time.perf_counter()
    (one,) = llm.generate(["Write a story about a lighthouse keeper."], greedy, use_tqdm=False)
    single = time.perf_counter() - started
    started = time.perf_counter()
    outs = llm.generate(prompts, crowd, use_tqdm=False)
    mixed = time.perf_counter() - started
    print(json.dumps({"single_tok_s": len(one.outputs[0].token_ids) / single,
                      "mixed_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / mixed,
                      "text": one.outputs[0].text}), flush=True)
'''


def unpack(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def start(tree: Path, model: str | None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, *([model] if model else [])], cwd=tree, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    json.loads(worker.stdout.readline())
    return worker


def one_round(worker: subprocess.Popen) -> dict:
    worker.stdin.write("go\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--model", help="a model path for both (default: the embedded default model)")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()
    model = str(Path(args.model).resolve()) if args.model else None
    with tempfile.TemporaryDirectory() as tmp:
        workers = {rev: start(unpack(rev, Path(tmp) / name), model)
                   for rev, name in ((args.old, "old"), (args.new, "new"))}
        runs = {rev: [] for rev in workers}
        for r in range(args.rounds):
            order = [args.old, args.new] if r % 2 == 0 else [args.new, args.old]
            for rev in order:
                runs[rev].append(one_round(workers[rev]))
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    sys.path.insert(0, str(ROOT))
    from nanoserve.bench.common import machine

    host = machine()
    print({k: host[k] for k in ("cpu", "torch", "threads", "torch_cpu_capability")}, args.model or "default model")
    same_text = runs[args.old][0]["text"] == runs[args.new][0]["text"]
    rows = []
    for rev in (args.old, args.new):
        rows.append({"rev": rev, **{k: statistics.median(x[k] for x in runs[rev]) for k in ("single_tok_s", "mixed_tok_s")}})
    ratio = {k: rows[1][k] / rows[0][k] for k in ("single_tok_s", "mixed_tok_s")}
    print(f"{'rev':<12} {'single tok/s':>13} {'mixed tok/s':>12}   ({args.rounds} rounds, medians)")
    for row in rows:
        print(f"{row['rev']:<12} {row['single_tok_s']:>13.2f} {row['mixed_tok_s']:>12.2f}")
    print(f"{'new / old':<12} {ratio['single_tok_s']:>13.3f} {ratio['mixed_tok_s']:>12.3f}")
    print(f"same single-stream text: {same_text}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare-commits.json").write_text(json.dumps({"machine": host, "model": args.model, "rows": rows,
                                                          "ratio": ratio, "same_text": same_text, "runs": runs},
                                                         indent=2))
    with open(out / "compare-commits.csv", "w") as f:
        f.write("rev,round,single_tok_s,mixed_tok_s\n")
        for rev, rounds in runs.items():
            for i, x in enumerate(rounds):
                f.write(f"{rev},{i},{x['single_tok_s']:.3f},{x['mixed_tok_s']:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
