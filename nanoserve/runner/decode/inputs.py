"""Persistent decode inputs: buffers allocated once and written in place, so every step hands the forward the
same addresses (what a replayed CUDA graph reads, since replay() takes no arguments).

InputBuffer is a [max_rows, *tail] int64 device buffer plus a host staging mirror (pinned on CUDA; on the CPU
the mirror is the buffer). A write goes through the mirror's numpy view (no allocation) and one copy down;
`window(rows)` is buffer[:rows], the same storage at the same address.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoserve.errors import GateError

INPUT_NAMES = ("input_ids", "positions", "write_slots", "context_lens", "logits_rows")


class InputBuffer:
    def __init__(self, name: str, max_rows: int, device: torch.device):
        self.name, self.max_rows = name, max_rows
        self.buffer = torch.zeros(max_rows, dtype=torch.int64, device=device)
        on_cuda = self.buffer.device.type == "cuda"
        self.staging = torch.zeros(max_rows, dtype=torch.int64, pin_memory=True) if on_cuda else self.buffer
        self._flat = self.staging.numpy()
        self.address = self.buffer.data_ptr()
        self.writes = 0
        self.bytes_written = 0

    def write(self, values: list[int], window: int | None = None) -> torch.Tensor:
        """Put `values` in rows [0, len) and return the window [0, window or len)."""
        n = len(values)
        check_inputs_fit(self, window or n)
        self._flat[:n] = values
        if self.staging is not self.buffer:
            self.buffer[:n].copy_(self.staging[:n], non_blocking=True)
        self.writes += 1
        self.bytes_written += n * 8
        return self.window(window or n)

    def window(self, rows: int) -> torch.Tensor:
        return self.buffer[:rows]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * 8


class DecodeInputs:
    """The decode step's inputs, one set for every shape: a shape's window is a prefix of the same storage."""

    def __init__(self, max_rows: int, device: torch.device):
        self.buffers = {name: InputBuffer(name, max_rows, device) for name in INPUT_NAMES}
        self.buffers["logits_rows"].write(list(range(max_rows)))  # row i's logits are row i's: written once

    def __getitem__(self, name: str) -> InputBuffer:
        return self.buffers[name]

    def addresses(self) -> dict[str, int]:
        return {name: b.address for name, b in self.buffers.items()}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    @property
    def writes(self) -> int:
        return sum(b.writes for b in self.buffers.values())

    @property
    def bytes_written(self) -> int:
        return sum(b.bytes_written for b in self.buffers.values())


STEP_INPUTS = ("input_ids", "positions", "slots", "decode_context_lens", "logits_indices", "decode_block_table")


@dataclass
class InputStats:
    """What the decode-only steps handed the forward, measured: each of a step's six input tensors is looked up
    by the address of its storage. One that lies in a persistent buffer (the DecodeInputs or the slot table)
    is a window; any other was allocated for that step. So a buffer that moved, or a code path that built a
    tensor instead of writing one, shows as a fresh allocation whatever the switches say.
    """

    persistent: bool
    table: bool  # the block table lives in a SlotTable (persistent inputs or compaction)
    steps: int = 0  # decode-only steps planned by the fast path
    fresh_allocations: int = 0  # step inputs whose storage is not a persistent buffer
    buffered_windows: int = 0  # step inputs that are windows of a persistent buffer
    _sets: set = field(default_factory=set)  # storage addresses of the steps whose inputs were all windows

    def observe(self, batch, persistent_storages: frozenset[int]) -> None:
        storages = tuple(getattr(batch, name).untyped_storage().data_ptr() for name in STEP_INPUTS)
        fresh = sum(ptr not in persistent_storages for ptr in storages)
        self.steps += 1
        self.fresh_allocations += fresh
        self.buffered_windows += len(storages) - fresh
        if not fresh:
            self._sets.add(storages)

    @property
    def sets(self) -> int:
        """Distinct sets of buffer addresses the all-window steps used: 1 when one set serves every step."""
        return len(self._sets)

    def as_dict(self) -> dict:
        return {"persistent": self.persistent, "steps": self.steps, "fresh_allocations": self.fresh_allocations,
                "fresh_per_step": self.fresh_allocations / self.steps if self.steps else 0.0,
                "buffered_windows": self.buffered_windows, "sets": self.sets}


# ---- gates ----------------------------------------------------------------------------------------------
def check_inputs_fit(buffer: InputBuffer, rows: int) -> None:
    if rows > buffer.max_rows:
        raise GateError(f"{buffer.name}: a step of {rows} rows does not fit the {buffer.max_rows}-row buffer; "
                        "size the buffers from max_num_seqs (the largest bucket)")


def check_addresses_stable(inputs: DecodeInputs, recorded: dict[str, int]) -> None:
    """Every buffer is still where it was when `recorded` was taken (a replay reads those addresses)."""
    moved = [n for n, b in inputs.buffers.items() if b.buffer.data_ptr() != recorded.get(n)]
    if moved:
        raise GateError(f"input buffer(s) {moved} moved since they were recorded; a replay would read freed "
                        "memory: allocate DecodeInputs once and only ever write into it")


def _is_window_of(tensor: torch.Tensor, buffer: InputBuffer) -> bool:
    return tensor.data_ptr() == buffer.address and tensor.untyped_storage().data_ptr() == \
        buffer.buffer.untyped_storage().data_ptr()


def check_step_inputs_persistent(batch, inputs: DecodeInputs) -> None:
    """The step's input tensors are windows of the persistent buffers, not fresh tensors."""
    pairs = {"input_ids": batch.input_ids, "positions": batch.positions, "write_slots": batch.slots,
             "context_lens": batch.decode_context_lens, "logits_rows": batch.logits_indices}
    fresh = [name for name, t in pairs.items() if not _is_window_of(t, inputs[name])]
    if fresh:
        raise GateError(f"step input(s) {fresh} are fresh tensors, not windows of the persistent buffers; "
                        "a replay would never see them: write them through DecodeInputs")


def check_plan_inputs_persistent(plan, inputs: DecodeInputs) -> None:
    """A plan built for replay holds windows of the buffers for the inputs it planned."""
    pairs = {"positions": plan.positions, "write_slots": plan.write_slots, "context_lens": plan.context_lens}
    fresh = [name for name, t in pairs.items() if not _is_window_of(t, inputs[name])]
    if fresh:
        raise GateError(f"plan input(s) {fresh} are not windows of the persistent buffers; build the plan with "
                        "persistent inputs on")


def check_one_set_covers(inputs: DecodeInputs, shapes: list[tuple[int, int]]) -> None:
    """One buffer set serves every shape: each shape's rows are a prefix of the buffers."""
    too_wide = [s for s in shapes if s[0] > min(b.max_rows for b in inputs.buffers.values())]
    if too_wide:
        raise GateError(f"shapes {too_wide} have more rows than the input buffers; size them from the largest bucket")
