"""DecodePath: plans a decode-only step with the switches in force (buckets, persistent inputs, compaction).

Mixed steps (decodes beside prefill chunks) keep the engine's general builder; a decode-only step, the steady
state of serving, comes here. Every switch changes where the numbers live, never what they are, so outputs are
identical with any combination on or off; the counters say what each switch did.
"""

from __future__ import annotations

import torch

from nanoserve.errors import GateError
from nanoserve.model.batch import StepBatch
from nanoserve.runner.batch import decode_rows
from nanoserve.runner.decode.buckets import DecodeBuckets
from nanoserve.runner.decode.inputs import DecodeInputs, InputStats
from nanoserve.runner.decode.plan import DecodePlan, check_plan_current, check_window_intact
from nanoserve.runner.decode.slots import SlotTable

WINDOW_GATE_EVERY = 32  # check_window_intact reads the block table back (a device sync on CUDA): sampled


class DecodePath:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device, *,
                 buckets: bool, persistent: bool, compaction: bool,
                 full_logits: bool = False, width_axis: bool = True):
        """`full_logits`: logits for every row of the shape, padded ones too (a captured graph's fixed output)."""
        self.block_size, self.device, self.full_logits = block_size, device, full_logits
        self.verify = False  # run every gate on every step (tests turn it on); otherwise the table gate is sampled
        self.gates = {"plan_current": [0, 0], "window_intact": [0, 0]}  # gate -> [ran, failed]
        # the streamed read holds one tile whatever the width, so its shapes need no width axis
        self.buckets = DecodeBuckets(max_rows, max_blocks, width_axis=width_axis) if buckets else None
        self.inputs = DecodeInputs(max_rows, device) if persistent else None
        self.table = SlotTable(max_rows, max_blocks, device, compaction) if (persistent or compaction) else None
        self.stats = InputStats(persistent=persistent, table=self.table is not None)
        self._buffers = frozenset(
            [b.buffer.untyped_storage().data_ptr() for b in self.inputs.buffers.values()] if self.inputs else []
        ) | frozenset([self.table.table.untyped_storage().data_ptr()] if self.table is not None else [])
        self.last_plan: DecodePlan | None = None

    def build(self, requests: list) -> tuple[StepBatch, list]:
        """The StepBatch for one decode token per request, and the requests in row order (the sampling order)."""
        bs = self.block_size
        if self.table is not None:
            requests = self.table.arrange(requests)
        rows = len(requests)
        positions = [r.num_computed for r in requests]
        ids, slots, lens = decode_rows(requests, positions, bs)
        width = max(-(-n // bs) for n in lens)
        shape = self.buckets.shape_for(rows, width) if self.buckets else (rows, width)
        if self.buckets:
            self.buckets.record(rows, width, shape)
        pad = shape[0] - rows  # padded rows: token 0 at position 0, writing the null block's slot 0, length 1
        ids, positions, slots, lens = ids + [0] * pad, positions + [0] * pad, slots + [0] * pad, lens + [1] * pad
        if self.inputs is not None:
            batch = self._persistent_batch(ids, positions, slots, lens, shape,
                                           logits_rows=shape[0] if self.full_logits else rows)
        else:
            dev = self.device
            table = self.table.window(*shape) if self.table is not None else self._fresh_table(requests, shape)
            batch = StepBatch(
                input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
                slots=torch.tensor(slots, device=dev), num_decode=shape[0], decode_block_table=table,
                decode_context_lens=torch.tensor(lens, device=dev), prefills=(),
                logits_indices=torch.arange(rows, device=dev))
        plan = DecodePlan(
            rows=rows, shape=shape, request_keys=tuple(SlotTable.key(r) for r in requests),
            positions=batch.positions, write_slots=batch.slots, context_lens=batch.decode_context_lens,
            block_table=batch.decode_block_table, shared=self.inputs is not None,
            context_snapshot=tuple(lens[:rows]) if self.inputs is not None else None,
            write_snapshot=tuple(slots[:rows]) if self.inputs is not None else None,
        )
        self._gate("plan_current", check_plan_current, plan, requests)  # host numbers only: every step
        if self.verify or self.stats.steps % WINDOW_GATE_EVERY == 0:
            self._gate("window_intact", check_window_intact, plan, bs)
        self.stats.observe(batch, self._buffers)
        self.last_plan = plan
        return batch, requests

    def _gate(self, name: str, check, *args) -> None:
        """Run one gate and count it; a failure is raised (the step fails and its requests end with an error:
        a forward on a stale plan would be silently wrong)."""
        counts = self.gates[name]
        counts[0] += 1
        try:
            check(*args)
        except GateError:
            counts[1] += 1
            raise

    def placeholder(self, shape: tuple[int, int]) -> StepBatch:
        """A batch of padded rows only, on the persistent buffers: what a capture records against.

        Every row reads and writes the null block, so warming up and recording disturb no sequence.
        """
        rows = shape[0]
        return self._persistent_batch([0] * rows, [0] * rows, [0] * rows, [1] * rows, shape, logits_rows=rows)

    def _persistent_batch(self, ids, positions, slots, lens, shape: tuple[int, int], logits_rows: int) -> StepBatch:
        """The step's values written into the persistent buffers; the batch holds windows of them."""
        inputs = self.inputs
        return StepBatch(
            input_ids=inputs["input_ids"].write(ids), positions=inputs["positions"].write(positions),
            slots=inputs["write_slots"].write(slots), num_decode=shape[0],
            decode_block_table=self.table.window(*shape), decode_context_lens=inputs["context_lens"].write(lens),
            prefills=(), logits_indices=inputs["logits_rows"].window(logits_rows),
        )

    def _fresh_table(self, requests: list, shape: tuple[int, int]) -> torch.Tensor:
        rows, width = shape
        cells = [r.blocks[:width] + [0] * (width - len(r.blocks[:width])) for r in requests]
        cells += [[0] * width] * (rows - len(requests))
        return torch.tensor(cells, dtype=torch.int64, device=self.device).view(rows, width)

    def published(self) -> dict:
        """What this path publishes in the stats snapshot: `inputs`, and `buckets` when bucketing is on."""
        persistent = self.inputs is not None
        out = {"inputs": {
            **self.stats.as_dict(),
            "writes": self.inputs.writes if persistent else 0,
            "bytes_written": self.inputs.bytes_written if persistent else 0,
            "buffer_bytes": self.inputs.nbytes + self.table.table.numel() * 8 if persistent else 0,
            "row_moves": self.table.row_moves if self.table is not None else 0,
        }}
        if self.buckets is not None:
            out["buckets"] = self.buckets.as_dict()
        out["gates"] = {**{f"{name}_{what}": counts[i] for name, counts in self.gates.items()
                           for i, what in enumerate(("ran", "failed"))},
                        "window_intact_every": 1 if self.verify else WINDOW_GATE_EVERY}
        return out
