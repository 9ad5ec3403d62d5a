"""PagedRead: the one seam every attention read goes through (each step's AttentionStep), and ReadStats.

The mode is a choice that changes no output, so the read counts what it did: calls, rows, the score cells
a rectangle read is charged, and the cells this read actually held. Counts come from shapes the host
already has, never from a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention.fused import FusedInvariantStep
from nanoserve.attention.gathered import gathered_decode, gathered_mask
from nanoserve.attention.invariant import InvariantStep
from nanoserve.attention.prefill import prefill_attention, share_pasts
from nanoserve.attention.step import AttentionStep
from nanoserve.attention.tiled import tiled_decode
from nanoserve.errors import ConfigError
from nanoserve.optional import require

READ_MODES = ("gathered", "streamed")
STREAMED_NOT_INVARIANT = (
    "streamed_read walks the KV tiles with an online softmax, whose sums differ in the last bits from the "
    "batch-invariant attention's; run or A/B the streamed read without batch_invariant (--no-batch-invariant)")


def check_read_block(block: int | None) -> None:
    """The streamed read's tile width: a power of two (a Triton block shape) of at least tl.dot's 16."""
    if block is None or block < 16 or block & (block - 1):
        raise ConfigError(f"read_block must be a power of two >= 16 (tl.dot's smallest operand), got {block}")


@dataclass(frozen=True)
class ReadStats:
    mode: str
    block: int | None
    calls: int = 0
    rows: int = 0
    score_cells: int = 0
    held_cells: int = 0

    @property
    def saving(self) -> float:
        """Charged / held: 1.0 for the gathered read is a measurement (it holds what it is charged)."""
        return self.score_cells / self.held_cells if self.held_cells else 1.0

    def since(self, earlier: ReadStats) -> ReadStats:
        """The window between two readings of the same read; refuses readings of different modes."""
        if (earlier.mode, earlier.block) != (self.mode, self.block):
            raise ValueError(
                f"cannot subtract a {earlier.mode} reading from a {self.mode} one: they are different reads"
            )
        return ReadStats(
            self.mode,
            self.block,
            self.calls - earlier.calls,
            self.rows - earlier.rows,
            self.score_cells - earlier.score_cells,
            self.held_cells - earlier.held_cells,
        )

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "block": self.block,
            "calls": self.calls,
            "rows": self.rows,
            "score_cells": self.score_cells,
            "held_cells": self.held_cells,
            "saving": self.saving,
        }


def _streamed(q, k_cache, v_cache, block_table, context_lens, scale: float, block: int) -> torch.Tensor:
    """The streamed read for q's device: the Triton kernel with CUDA, its torch twin without (tiled.py)."""
    if q.is_cuda:
        from nanoserve.attention.streamed import streamed_decode  # Triton, imported only where it compiles

        return streamed_decode(q, k_cache, v_cache, block_table, context_lens, scale, block=block)
    return tiled_decode(q, k_cache, v_cache, block_table, context_lens, scale, block)


def paged_read_for(streamed: bool, block: int, device: torch.device, invariant: bool = False) -> PagedRead:
    """The read a config asks for on `device`. On CUDA the streamed read is the Triton kernel, so Triton is
    required here, at start-up, not at the first decode step; elsewhere it is the torch twin (tiled.py).
    `invariant`: the batch-invariant attention (nanoserve/attention/invariant.py) serves decode and prefill."""
    if not streamed:
        return PagedRead("gathered", invariant=invariant)
    if device.type == "cuda":
        require("triton", "--streamed-read on CUDA (the compiled kernel)")
    return PagedRead("streamed", block, invariant=invariant)


class PagedRead:
    """Owns the read mode and dispatches decode attention to it, counting as it goes."""

    def __init__(self, mode: str = "gathered", block: int | None = None, invariant: bool = False):
        if mode not in READ_MODES:
            raise ValueError(f"read mode {mode!r} is not available; choose one of {READ_MODES}")
        if mode == "streamed":
            check_read_block(block)
            if invariant:
                raise ConfigError(STREAMED_NOT_INVARIANT)
        self.mode = mode
        self.invariant = invariant
        self.block = block if mode == "streamed" else None
        self._calls = self._rows = self._score = self._held = 0

    def step(self, batch, cache, fused=None) -> AttentionStep:
        """This read over one step (see AttentionStep), for every layer of the step to call: the decode rows
        through this mode and the prefill segments through the prefill attention; when batch-invariant, the
        invariant attention over the whole step, on the fused CPU kernel when `fused` (its kernels, the
        attention's output dtype) is given."""
        if self.invariant:
            if fused is not None:
                return FusedInvariantStep(self, batch, cache, *fused)
            return InvariantStep(self, batch, cache)
        return StepRead(self, batch.decode_block_table, batch.decode_context_lens, cache.block_size, batch, cache)

    def decode(self, q, k_cache, v_cache, block_table, context_lens, scale: float) -> torch.Tensor:
        """One read on its own (a step's layers go through `step` instead)."""
        return StepRead(self, block_table, context_lens, k_cache.shape[1]).decode(q, k_cache, v_cache, scale)

    def run(self, q, k_cache, v_cache, block_table, context_lens, scale: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel of this mode, uncounted (StepRead counts); `mask` is the gathered read's, built once a step."""
        if self.mode == "streamed":
            return _streamed(q, k_cache, v_cache, block_table, context_lens, scale, self.block)
        return gathered_decode(q, k_cache, v_cache, block_table, context_lens, scale, mask=mask)

    def reset(self) -> None:
        """Forget what was counted (reads during warm-up or capture are not serving reads)."""
        self._calls = self._rows = self._score = self._held = 0

    def charge(self, rows: int, heads: int, width: int, calls: int = 1) -> None:
        """Count `calls` reads of `rows` rows x `heads` heads over `width` cached positions (shapes only).

        A replayed CUDA graph runs its reads without calling `decode`, so the replay charges them here.
        """
        cells = rows * heads * width
        held = rows * heads * min(width, self.block) if self.mode == "streamed" else cells  # one tile alive
        self._calls += calls
        self._rows += rows * calls
        self._score += cells * calls
        self._held += held * calls

    def stats(self) -> ReadStats:
        return ReadStats(self.mode, self.block, self._calls, self._rows, self._score, self._held)


class StepRead(AttentionStep):
    """One step through the gathered or streamed read: its decode rows (block table and context lengths) read
    their context from the cache; its prefill segments attend the cached past and their own k and v
    (nanoserve/attention/prefill.py), so a step with prefills is not `cached_only`.

    What depends only on the rows, not on the layer (the gathered read's mask), is built by the first layer's
    call and reused by the others; it lives only as long as the step's forward, inside a captured graph too.
    """

    def __init__(self, read: PagedRead, block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 batch=None, cache=None):
        super().__init__(read, batch, cache)
        self.block_table, self.context_lens = block_table, context_lens
        self.width = block_table.shape[1] * block_size
        self._mask: torch.Tensor | None = None
        self.cached_only = batch is None or not batch.prefills
        # continuing prefill segments grouped by the cache blocks of their pasts, once a step for every layer
        self.pasts = () if self.cached_only else share_pasts(batch.prefills, batch.prefill_tables, block_size,
                                                              block_table.device)
        if block_table.shape[0] != context_lens.shape[0]:
            raise ValueError(f"read got {block_table.shape[0]} table rows and {context_lens.shape[0]} lengths")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        batch = self.batch
        nd = batch.num_decode
        if self.cached_only:
            return self.decode(q, k_cache, v_cache, scale)
        parts = [self.decode(q[:nd], k_cache, v_cache, scale)] if nd else []
        parts.append(prefill_attention(q, k, v, batch.prefills, self.pasts, k_cache, v_cache, scale))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        rows, heads, _ = q.shape
        if self.block_table.shape[0] != rows:
            raise ValueError(f"read got {rows} query rows but {self.block_table.shape[0]} table rows")
        read = self.read
        read.charge(rows, heads, self.width)
        if read.mode == "gathered" and self._mask is None:
            self._mask = gathered_mask(self.block_table, self.context_lens, k_cache.shape[1])
        return read.run(q, k_cache, v_cache, self.block_table, self.context_lens, scale, mask=self._mask)
