"""`nanoserve bench inputs`: what persistent decode inputs cost and save on the host, no weights involved.

A decode-only step is planned over and over for a few rows of a larger cache: arm "fresh" builds every input
tensor anew (what the general builder does), arm "buffered" writes them into DecodeInputs and a SlotTable and
hands the forward windows. Reported per run length: tensors allocated (fresh -> buffered), buffer writes, cells
written, and host milliseconds spent planning, arms interleaved. A second table prices the memory: one input
set, a set per captured shape, and the block-table rectangle, at a serving-sized shape.
"""

from __future__ import annotations

import time

import torch

from nanoserve.bench.common import print_table, write_results
from nanoserve.request import Request
from nanoserve.runner.decode.buckets import DecodeBuckets
from nanoserve.runner.decode.inputs import INPUT_NAMES
from nanoserve.runner.decode.path import DecodePath
from nanoserve.sampling import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("inputs", help="persistent decode inputs: allocations and host ms per plan, fresh vs buffered")
    p.add_argument("--steps", type=int, nargs="+", default=[8, 64, 128, 512])
    p.add_argument("--rows", type=int, default=3, help="decoding rows")
    p.add_argument("--max-rows", type=int, default=8, help="rows the buffers are sized for")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench-results")


class Rows:
    """`rows` requests past a prompt, advanced one token per planned step, blocks appended as they fill."""

    def __init__(self, rows: int, prompt_len: int, block_size: int):
        self.block_size, self.next_block = block_size, 1
        self.requests = []
        for i in range(rows):
            req = Request(f"r{i}", None, list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=10**6)
            req.num_computed = prompt_len
            req.output_ids.append(1)
            self.requests.append(req)
            self._cover(req)

    def _cover(self, req: Request) -> None:
        while len(req.blocks) * self.block_size < req.num_computed + 1:
            req.blocks.append(self.next_block)
            self.next_block += 1

    def advance(self) -> None:
        for req in self.requests:
            req.num_computed += 1
            req.output_ids.append(1)
            self._cover(req)


def plan_run(buffered: bool, steps: int, args) -> dict:
    rows = Rows(args.rows, args.prompt_len, args.block_size)
    max_blocks = -(-(args.prompt_len + max(args.steps) + 1) // args.block_size)
    path = DecodePath(args.max_rows, max_blocks, args.block_size, torch.device("cpu"), buckets=False,
                      persistent=buffered, compaction=buffered)
    started = time.perf_counter()
    for _ in range(steps):
        path.build(rows.requests)
        rows.advance()
    seconds = time.perf_counter() - started
    s = path.published()["inputs"]
    return {"allocations": s["fresh_allocations"], "writes": s["writes"], "cells": s["bytes_written"] // 8,
            "table_cells": path.table.cells_written if path.table else None, "ms": seconds * 1000}


def memory_rows(max_rows: int = 256, max_model_len: int = 8192, block_size: int = 16) -> list[dict]:
    one_set = len(INPUT_NAMES) * max_rows * 8
    shapes = len(DecodeBuckets(max_rows, -(-max_model_len // block_size)).shapes)
    table = max_rows * -(-max_model_len // block_size) * 8
    return [{"what": f"one set of {len(INPUT_NAMES)} inputs", "bytes": one_set, "vs_one_set": 1.0},
            {"what": f"a set per captured shape ({shapes} shapes)", "bytes": one_set * shapes,
             "vs_one_set": float(shapes)},
            {"what": "the block-table rectangle", "bytes": table, "vs_one_set": table / one_set}]


def main(args) -> int:
    rows = []
    for steps in args.steps:
        runs = {"fresh": [], "buffered": []}
        for _ in range(args.repeats):  # interleaved, so drift lands on both arms
            for arm in runs:
                runs[arm].append(plan_run(arm == "buffered", steps, args))
        fresh, buffered = (sorted(runs[a], key=lambda r: r["ms"])[len(runs[a]) // 2] for a in ("fresh", "buffered"))
        rows.append({"steps": steps, "allocations_fresh": fresh["allocations"],
                     "allocations_buffered": buffered["allocations"], "writes": buffered["writes"],
                     "cells": buffered["cells"], "table_cells": buffered["table_cells"],
                     "plan_ms_fresh": fresh["ms"], "plan_ms_buffered": buffered["ms"],
                     "buffered_over_fresh": buffered["ms"] / fresh["ms"]})
    print_table(f"decode planning, {args.rows} rows of a {args.max_rows}-row cache, {args.prompt_len}-token prompts "
                f"(median of {args.repeats}, arms interleaved)", rows, list(rows[0]))
    memory = memory_rows()
    print_table("input memory at 256 rows and 8192 tokens", memory, ["what", "bytes", "vs_one_set"])
    path = write_results(args.out, "inputs", {"memory": memory}, rows, args)
    print(f"wrote {path}")
    return 0
