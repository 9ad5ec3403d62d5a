"""DecodeBuckets: the closed set of decode shapes a step is padded up to.

A captured graph is one shape, so the shapes must be few and known before the first request: rows come in
powers of two up to max_num_seqs, and (while the gathered read sizes its rectangle by the widest row) widths in
blocks come in powers of two up to what max_model_len needs. Padded rows write only to the null block and their
logits are dropped.
"""

from __future__ import annotations

import bisect

from nanoserve.errors import GateError

DEFAULT_CAPTURE_BUDGET = 128  # shapes; each captured graph costs capture time (the shared pool is sized by the largest)


def _ladder(top: int) -> list[int]:
    steps, n = [], 1
    while n < top:
        steps.append(n)
        n *= 2
    return steps + [top]


class DecodeBuckets:
    def __init__(self, max_rows: int, max_blocks: int, width_axis: bool = True):
        self.rows = _ladder(max_rows)
        self.widths = _ladder(max_blocks) if width_axis else [max_blocks]
        self.steps_by_shape: dict[tuple[int, int], int] = {}
        self.padded_rows = 0
        self.padded_cells = 0  # table cells a step carried beyond what its rows needed

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(r, w) for r in self.rows for w in self.widths]

    def shape_for(self, rows: int, width: int) -> tuple[int, int]:
        """The smallest bucket holding `rows` rows of `width` blocks."""
        r = self.rows[bisect.bisect_left(self.rows, rows)] if rows <= self.rows[-1] else None
        w = self.widths[bisect.bisect_left(self.widths, width)] if width <= self.widths[-1] else None
        if r is None or w is None:
            raise GateError(f"a decode step of {rows} rows x {width} blocks is outside the bucket set "
                            f"(up to {self.rows[-1]} rows x {self.widths[-1]} blocks)")
        return r, w

    def record(self, rows: int, width: int, shape: tuple[int, int]) -> None:
        self.steps_by_shape[shape] = self.steps_by_shape.get(shape, 0) + 1
        self.padded_rows += shape[0] - rows
        self.padded_cells += shape[0] * shape[1] - rows * width

    def as_dict(self) -> dict:
        return {"shapes": len(self.rows) * len(self.widths), "row_buckets": len(self.rows), "width_buckets": len(self.widths),
                "shapes_used": len(self.steps_by_shape), "padded_rows": self.padded_rows,
                "padded_cells": self.padded_cells}


def check_capture_budget(buckets: DecodeBuckets, budget: int = DEFAULT_CAPTURE_BUDGET) -> None:
    """Refuse a shape set too large to capture (each shape is a graph: capture time and pool memory)."""
    n = len(buckets.shapes)
    if n > budget:
        raise GateError(f"{n} decode shapes ({len(buckets.rows)} row buckets x {len(buckets.widths)} width "
                        f"buckets) exceed the capture budget of {budget}; lower --max-num-seqs or "
                        "--max-model-len, or use a read without a width axis")
