"""DecodePlan: a decode step's addressing, built before the forward from the host's own numbers.

It carries the tensors the forward reads (positions, write slots, context lengths, the block-table window) and,
when those tensors are shared buffers the next step writes through, host-side snapshots of what they held at
build time. A witness in shared storage always agrees with the present, so the gates read the snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.errors import GateError


@dataclass(frozen=True)
class DecodePlan:
    rows: int  # real rows (the rest of the window is padding)
    shape: tuple[int, int]  # (rows, width) of the window the forward reads
    request_keys: tuple  # row -> Request.key (serial, preemptions)
    positions: torch.Tensor
    write_slots: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor  # [shape rows, shape width] window of the SlotTable (or a fresh rectangle)
    shared: bool  # the tensors are windows of persistent buffers
    context_snapshot: tuple[int, ...] | None = None
    write_snapshot: tuple[int, ...] | None = None

    @property
    def context_list(self) -> list[int]:
        """The lengths as planned: the snapshot when the tensor is shared, else the tensor itself."""
        return self._planned(self.context_snapshot, self.context_lens)

    @property
    def write_list(self) -> list[int]:
        return self._planned(self.write_snapshot, self.write_slots)

    def _planned(self, snapshot: tuple[int, ...] | None, tensor: torch.Tensor) -> list[int]:
        if self.shared:
            check_snapshots_present(self)
            return list(snapshot)
        return tensor[: self.rows].tolist()


def check_snapshots_present(plan: DecodePlan) -> None:
    if plan.shared and (plan.context_snapshot is None or plan.write_snapshot is None):
        raise GateError("a plan over shared input buffers carries no snapshots: its own tensors change under it, "
                        "so nothing could show it is stale; build it with context and write snapshots")


def check_plan_current(plan: DecodePlan, requests: list) -> None:
    """The plan was built for these requests as they are now (one token each at their next position)."""
    keys = tuple(r.key for r in requests)
    if keys != plan.request_keys:
        raise GateError("the plan's rows are not this step's decode rows (a request joined, left or was "
                        "preempted since it was built); plan again")
    wanted = [r.num_computed + 1 for r in requests]
    if plan.context_list != wanted:
        stale = next(i for i, (a, b) in enumerate(zip(plan.context_list, wanted)) if a != b)
        raise GateError(f"row {stale} was planned at context {plan.context_list[stale]} but its request is at "
                        f"{wanted[stale]}: the plan is stale; plan again before the forward")


def check_window_intact(plan: DecodePlan, block_size: int) -> None:
    """Each row's write slot lies in the block its table row holds for that position (the table is intact)."""
    table = plan.block_table[: plan.rows].tolist()
    for row, (slot, length) in enumerate(zip(plan.write_list, plan.context_list)):
        position = length - 1
        block = table[row][position // block_size]
        if slot != block * block_size + position % block_size:
            raise GateError(f"row {row} writes slot {slot} but its table row holds block {block} for position "
                            f"{position}: the block-table window changed under the plan; plan again")
