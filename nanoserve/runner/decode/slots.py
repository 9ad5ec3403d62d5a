"""SlotTable: one persistent block-table rectangle [max_rows, blocks for max_model_len].

A decode step reads `window(rows, width)`: the same storage at the same address every step, so a captured
graph's table never moves. Its width covers max_model_len, so the longest legal request never overflows it.
Unused cells hold 0, the null block, which is legal everywhere (a padded row reads and writes only there).

Rows are kept a dense prefix. With compaction, a row keeps its index while it decodes and only the blocks it
gained are written; when it leaves, the last row moves into its place (one row copied). Without compaction the
window is rewritten in the scheduler's order every step.

Block numbers are written through a host mirror (pinned on CUDA; on the CPU the mirror is the table), the way
InputBuffer writes its values: a numpy slice assignment and one non-blocking copy per written span, so a step
allocates nothing and never waits on the device. (A step's sampled tokens come back to the host before the
next step writes, so the mirror is never rewritten under a copy still in flight.)
"""

from __future__ import annotations

import torch


class SlotTable:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device, compaction: bool):
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int64, device=device)
        on_cuda = self.table.device.type == "cuda"
        self.staging = torch.zeros(max_rows, max_blocks, dtype=torch.int64, pin_memory=True) if on_cuda else self.table
        self._cells = self.staging.numpy()
        self.address = self.table.data_ptr()
        self.compaction = compaction
        self._keys: list[tuple] = []  # row -> the request occupying it (Request.key)
        self._written: list[int] = []  # row -> block entries written
        self._high_water = 0  # rows [0, high_water) may hold non-zero cells
        self.cells_written = 0
        self.row_moves = 0

    @staticmethod
    def key(request) -> tuple:
        """A request's identity for the table (Request.key: a serial that never repeats, and its preemptions)."""
        return request.key

    def arrange(self, requests: list) -> list:
        """Fit the table to this step's decode rows; returns them in row order (row i is requests[i])."""
        if self.compaction:
            return self._compact(requests)
        for row, req in enumerate(requests):
            self._write_row(row, req.blocks, 0)
        self._clear_rows(len(requests))
        self._keys = [self.key(r) for r in requests]
        return list(requests)

    def _compact(self, requests: list) -> list:
        by_key = {self.key(r): r for r in requests}
        row = 0
        while row < len(self._keys):  # release rows whose request is gone: the last row fills the hole
            if self._keys[row] in by_key:
                row += 1
                continue
            last = len(self._keys) - 1
            if row != last:
                width = self._written[last]
                self.table[row, :width] = self.table[last, :width]
                if self._written[row] > width:
                    self.table[row, width:self._written[row]] = 0
                self._keys[row], self._written[row] = self._keys[last], width
                self.row_moves += 1
            self.table[last, :self._written[last]] = 0
            self._keys.pop()
            self._written.pop()
        placed = set(self._keys)
        for req in requests:
            if self.key(req) not in placed:
                self._keys.append(self.key(req))
                self._written.append(0)
        ordered = [by_key[k] for k in self._keys]
        for row, req in enumerate(ordered):
            if len(req.blocks) > self._written[row]:
                self._write_row(row, req.blocks, self._written[row])
        return ordered

    def _write_row(self, row: int, blocks: list[int], start: int) -> None:
        end = stop = len(blocks)
        self._cells[row, start:end] = blocks[start:]
        if not self.compaction:  # rewritten whole: the row's previous occupant may have been longer
            self._cells[row, end:] = 0
            stop = self._cells.shape[1]
        elif row < len(self._written):
            self._written[row] = end
        if self.staging is not self.table and stop > start:
            self.table[row, start:stop].copy_(self.staging[row, start:stop], non_blocking=True)
        self.cells_written += end - start
        self._high_water = max(self._high_water, row + 1)

    def _clear_rows(self, rows: int) -> None:
        if self._high_water > rows:
            self.table[rows:self._high_water] = 0
            self._high_water = rows

    def window(self, rows: int, width: int) -> torch.Tensor:
        return self.table[:rows, :width]
