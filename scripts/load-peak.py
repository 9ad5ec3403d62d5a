#!/usr/bin/env python3
"""A model's load alone: seconds to a servable engine, then resident memory and its peak so far (VmHWM), after the
packed weights' move onto huge pages. `nanoserve bench sizes` reports the peak over a whole run (its workloads'
KV pages and activations too); this is the load's own, the figure a load's transient copies move.

    python scripts/load-peak.py FILE.gguf [--kv-cache-gib 0.25] [--max-model-len 512]
"""

from __future__ import annotations

import argparse
import time


def status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    from nanoserve import LLM

    started = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
              enable_prefix_caching=False)
    loaded = time.perf_counter() - started
    fused = llm.engine.runner.loaded.fused
    if fused is not None and fused.huge_pages is not None:
        fused.huge_pages.done.wait()
    print(f"load {loaded:.2f} s, with the move onto huge pages {time.perf_counter() - started:.2f} s; "
          f"RSS {status_mib('VmRSS'):.0f} MiB, peak {status_mib('VmHWM'):.0f} MiB")


if __name__ == "__main__":
    main()
