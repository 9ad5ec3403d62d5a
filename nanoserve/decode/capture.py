"""CapturedDecode: one CUDA graph per decode bucket, replayed by writing the input buffers and calling replay().

A replay takes no arguments: it re-runs the recorded kernels on the addresses they were recorded against. So
before anything is recorded the gates check what replay relies on: persistent inputs (check_addresses_stable,
check_step_inputs_persistent), a closed shape set within budget (check_capture_budget, check_one_set_covers) and
a block-table window that never moves. Graphs are captured largest first into one shared memory pool, so the
smaller ones reuse the largest one's workspace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoserve.decode.buckets import DEFAULT_CAPTURE_BUDGET, check_capture_budget
from nanoserve.decode.inputs import check_addresses_stable, check_one_set_covers, check_step_inputs_persistent
from nanoserve.decode.path import DecodePath
from nanoserve.errors import ConfigError, GateError


@dataclass
class CaptureStats:
    shapes: int = 0  # shapes in the captured set
    captures: int = 0
    replays: int = 0
    eager_steps: int = 0  # decode-only steps that ran eager (outside the captured set)
    pool_bytes: int = 0  # device memory the graphs' shared pool holds
    capture_seconds: float = 0.0

    @property
    def replay_share(self) -> float:
        done = self.replays + self.eager_steps
        return self.replays / done if done else 0.0

    def as_dict(self) -> dict:
        return {"shapes": self.shapes, "captures": self.captures, "replays": self.replays,
                "eager_steps": self.eager_steps, "replay_share": self.replay_share, "pool_bytes": self.pool_bytes,
                "capture_seconds": self.capture_seconds}


def check_capture_possible(path: DecodePath, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError("CUDA-graph capture needs a CUDA device; turn capture off (decode_buckets, "
                          "persistent_inputs and row_compaction work without it)")
    if path.inputs is None or path.buckets is None or path.table is None:
        raise GateError("capture needs persistent inputs, decode buckets and the slot table: a replay reads "
                        "fixed addresses in fixed shapes; turn them on (--cuda-graphs bundles them)")


class CapturedDecode:
    def __init__(self, model, cache, read, path: DecodePath, heads: int, layers: int,
                 capture_budget: int = DEFAULT_CAPTURE_BUDGET):
        check_capture_possible(path, cache.k.device)
        check_capture_budget(path.buckets, capture_budget)
        check_one_set_covers(path.inputs, path.buckets.shapes)
        self.model, self.cache, self.read, self.path = model, cache, read, path
        self.heads, self.layers = heads, layers
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.stats = CaptureStats(shapes=len(path.buckets.shapes))
        self.addresses = path.inputs.addresses()
        self.table_address = path.table.address

    def capture(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """Record every shape (or `shapes`), largest first, into one pool; measure the pool."""
        started = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(shapes or self.path.buckets.shapes, reverse=True):
            batch = self.path.placeholder(shape)
            check_step_inputs_persistent(batch, self.path.inputs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():  # warm-up: lazy inits happen outside the graph
                self.model(batch, self.cache, self.read)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                self.logits[shape] = self.model(batch, self.cache, self.read)
            self.graphs[shape] = graph
            self.stats.captures += 1
        torch.cuda.synchronize()
        self.read.reset()  # warm-ups and captures read nothing real
        self.stats.pool_bytes = torch.cuda.memory_reserved() - before
        self.stats.capture_seconds = time.perf_counter() - started

    def replay(self, shape: tuple[int, int], rows: int) -> torch.Tensor | None:
        """Logits for the step the path just planned (its inputs are already in the buffers), or None."""
        graph = self.graphs.get(shape)
        if graph is None:
            self.stats.eager_steps += 1
            return None
        check_addresses_stable(self.path.inputs, self.addresses)
        if self.path.table.table.data_ptr() != self.table_address:
            raise GateError("the slot table moved since capture; a replay would read freed memory")
        graph.replay()
        self.stats.replays += 1
        self.read.charge(shape[0], self.heads, shape[1] * self.cache.block_size, calls=self.layers)
        return self.logits[shape][:rows]
