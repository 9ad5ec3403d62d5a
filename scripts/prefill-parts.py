"""Where a long prompt's prefill time goes: read whole on an idle engine, or in chunks beside a stream's decode row
(what the step-time budget does), on the default model.

Each chunk size runs in a fresh engine; the fused C calls and the 4-/8-bit linears are timed around each call, the
rest of the step (Python, the sampler, the scheduler) is what is left. Prints one line a chunk size and writes
JSON with --out.

    python scripts/prefill-parts.py --chunks 1750 31 15 --out prefill-parts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.model.quant.linears import KernelLinear

FUSED = ("add_norm", "rope_store", "attention", "silu_mul", "rescore")


def _timed(engine) -> collections.Counter:
    """Time every fused call and every kernel linear of `engine` into the returned counter (seconds)."""
    spent, kernels = collections.Counter(), engine.runner.model.fused
    for name in FUSED:
        def timed(*a, _f=getattr(kernels, name), _n=name, **kw):
            t = time.perf_counter()
            out = _f(*a, **kw)
            spent[_n] += time.perf_counter() - t
            return out
        setattr(kernels, name, timed)
    forward = KernelLinear.forward

    def timed_linear(self, x):
        t = time.perf_counter()
        out = forward(self, x)
        spent["head" if self.out_features > 10000 else "projections"] += time.perf_counter() - t
        return out

    KernelLinear.forward = timed_linear
    return spent


def parts(chunk: int, prompt: list[int]) -> dict:
    """The prompt's prefill in chunks of `chunk` tokens, beside one decoding stream unless the chunk takes the
    whole prompt (then alone): ms by part."""
    engine = LLM(max_model_len=2048, kv_cache_gib=0.2, max_num_batched_tokens=max(chunk + 1, 64), max_num_seqs=2,
                 enable_prefix_caching=False, max_step_ms=0).engine
    engine.scheduler.max_num_batched_tokens = chunk + 1  # one decode row and `chunk` prompt tokens a step
    spent = _timed(engine)
    if chunk < len(prompt):
        engine.add_request(prompt[:20], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
        for _ in range(5):
            engine.step()
    spent.clear()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), streamed=False)
    started, steps, done = time.perf_counter(), 0, False
    while not done:
        done = any(o.request_id == rid and o.finished for o in engine.step())
        steps += 1
    total = time.perf_counter() - started
    row = {"chunk": chunk, "steps": steps, "total_ms": round(1000 * total)}
    row.update({k: round(1000 * v) for k, v in sorted(spent.items())})
    row["rest_ms"] = round(1000 * (total - sum(spent.values())))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[1750, 31, 15])
    p.add_argument("--prompt-tokens", type=int, default=1750)
    p.add_argument("--out")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.prompt_tokens,), generator=g).tolist()
    rows = []
    for chunk in args.chunks:
        rows.append(parts(chunk, prompt))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
