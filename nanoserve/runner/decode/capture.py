"""CapturedDecode: one CUDA graph per decode bucket, replayed by writing the input buffers and calling replay().

A replay takes no arguments: it re-runs the recorded kernels on the addresses they were recorded against. So
before anything is recorded the gates check what replay relies on: persistent inputs (check_addresses_stable,
check_step_inputs_persistent), a closed shape set within budget (check_capture_budget, check_one_set_covers) and
a block-table window that never moves. Graphs are captured largest first into one shared memory pool, so the
smaller ones reuse the largest one's workspace, and every graph copies its logits into one shared output buffer
(rows of the largest shape x vocab, float32): a buffer per shape would hold 0.65-0.8 GB at 64 rows for a 150k
vocabulary. Every CUDA call names the cache's device, so capture on cuda:1 records on cuda:1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoserve.errors import ConfigError, GateError
from nanoserve.runner.decode.buckets import DEFAULT_CAPTURE_BUDGET, check_capture_budget
from nanoserve.runner.decode.inputs import (
    check_addresses_stable,
    check_one_set_covers,
    check_step_inputs_persistent,
)
from nanoserve.runner.decode.path import DecodePath


@dataclass
class CaptureStats:
    shapes: int = 0  # shapes in the captured set
    captures: int = 0
    replays: int = 0
    eager_steps: int = 0  # decode-only steps that ran eager (outside the captured set)
    pool_bytes: int = 0  # device memory the graphs hold: their shared pool and the shared logits buffer
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
        self.device = cache.k.device
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # every graph's output: [rows of the largest shape, vocab]
        self.stats = CaptureStats(shapes=len(path.buckets.shapes))
        self.addresses = path.inputs.addresses()
        self.table_address = path.table.address

    def capture(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """Record every shape (or `shapes`), largest first, into one pool; measure what they hold.

        The measure is the device memory reserved after a synchronise with the allocator's cache emptied, before
        and after: entering `torch.cuda.graph` empties the cache itself (so a plain difference of reserved bytes
        can come out too small, even negative), and allocated bytes miss the workspace the graphs' private pool
        keeps for its replays once capture has freed it."""
        started = time.perf_counter()
        with torch.cuda.device(self.device):
            before = self._held_bytes()
            pool = torch.cuda.graph_pool_handle()
            order = sorted(shapes or self.path.buckets.shapes, reverse=True)
            for shape in order:
                batch = self.path.placeholder(shape)
                check_step_inputs_persistent(batch, self.path.inputs)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream), torch.inference_mode():  # warm-up: lazy inits outside the graph
                    logits = self.model(batch, self.cache, self.read)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                if self.logits is None:  # outside the pool, sized by the first (largest) shape
                    self.logits = torch.empty(order[0][0], logits.shape[-1], dtype=logits.dtype, device=self.device)
                del logits
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                    self.logits[: shape[0]].copy_(self.model(batch, self.cache, self.read))
                self.graphs[shape] = graph
                self.stats.captures += 1
            self.stats.pool_bytes = self._held_bytes() - before
        self.read.reset()  # warm-ups and captures read nothing real
        self.stats.capture_seconds = time.perf_counter() - started

    def _held_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # within `torch.cuda.device(self.device)`: this device's cache
        return torch.cuda.memory_reserved(self.device)

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
        return self.logits[:rows]
