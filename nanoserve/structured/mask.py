"""The per-step token mask of constrained rows: filled by llguidance (in parallel across rows), applied to
those rows' logits only, so the batch's other rows are untouched."""

from __future__ import annotations

import math
import time

import torch

from nanoserve.structured.grammars import GrammarStats, Matcher

# byte value -> its 8 bits, least significant first, as "forbidden" flags: a little-endian int32 bitmask read as
# bytes lists tokens in order (token 32w + b is bit b % 8 of byte 4w + b // 8)
_FORBIDDEN = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0


class GrammarMasker:
    """Fills one bitmask row per constrained sequence and sets every token its grammar forbids to -inf."""

    def __init__(self, stats: GrammarStats | None = None, threads: int | None = None):
        self.stats = stats if stats is not None else GrammarStats()
        self._threads = threads or max(1, torch.get_num_threads())
        self._executor = None
        self._tables: dict = {}

    def _table(self, device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = _FORBIDDEN.to(device)
        return table

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
        """Mask `logits[rows]` ([rows, vocab] float32, modified in place) by each row's matcher."""
        started = time.perf_counter()
        vocab = logits.shape[-1]
        words = -(-vocab // 32)
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        self._fill(matchers, bitmask)
        # the bitmask crosses to the logits' device (vocab / 8 bytes a row) and is unpacked there
        packed = bitmask.view(torch.uint8).to(logits.device, non_blocking=True).long()
        forbidden = self._table(logits.device)[packed].view(len(rows), -1)[:, :vocab]
        if rows == list(range(logits.shape[0])):  # every row constrained: in place, no gather and scatter
            logits.masked_fill_(forbidden, -math.inf)
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(forbidden, -math.inf)
        self.stats.masked_rows += len(rows)
        spent = time.perf_counter() - started
        self.stats.mask_seconds += spent
        for matcher in matchers:  # each sequence's share, for its timeline
            matcher.spent(spent / len(matchers))

    def _fill(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Each row's mask. A row whose grammar fails is recorded on its matcher (the engine ends that request)
        and allows every token, so the batch samples as it would without it."""
        try:
            self._compute(matchers, bitmask)
        except Exception:
            if all(m.check() for m in matchers):
                raise  # no grammar owns it: the step's fault
            for i, matcher in enumerate(matchers):  # the others' masks again, one at a time
                if matcher.failure is None:
                    self._compute([matcher], bitmask[i:i + 1])
        for i, matcher in enumerate(matchers):
            if not matcher.check():
                bitmask[i] = -1

    def _compute(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        import llguidance

        if len(matchers) == 1:
            row = bitmask[0]
            matchers[0].inner.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._threads)
        self._executor.unsafe_compute_mask_ptr([(m.inner, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
