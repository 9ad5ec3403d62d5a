"""The general batch builder: any mix of decode rows and prefill chunks (a SchedulerOutput) as a StepBatch.

The decode fast path (runner/decode/) plans decode-only steps; this builder serves every other step and shares
`decode_rows` with it, so both address a decode token the same way.
"""

from __future__ import annotations

import torch

from nanoserve.model.batch import PrefillSegment, StepBatch


def decode_rows(requests: list, positions: list[int], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """One decode token per request at `positions`: its input token, the KV slot it writes, and the context
    length it attends over (everything up to and including itself). Shared by the general and fast builders."""
    ids = [r.tokens(p, p + 1)[0] for r, p in zip(requests, positions)]
    slots = [r.blocks[p // block_size] * block_size + p % block_size for r, p in zip(requests, positions)]
    return ids, slots, [p + 1 for p in positions]


def general_batch(sched, block_size: int, device) -> tuple[StepBatch, list, list[tuple], list[tuple]]:
    """The StepBatch for any mix of decodes and prefill chunks (a SchedulerOutput), the requests it samples (in
    logits order), the (request, position) pairs whose logits score the next prompt token (prompt_logprobs), and
    for each sampled row the drafted tokens before its position (() but in a verified draft's run).

    A decode row with drafts is computed as a segment over its last token and its drafts, each position
    sampled: its rows come together, in position order. Logits come back for the sampled rows first, then for
    those prompt positions, in the returned order.
    """
    bs = block_size
    logits_at: list[int] = []
    sampled: list = []
    prompt_at: list[int] = []
    prompt_rows: list[tuple] = []
    decodes = [c for c in sched.decodes if not c.drafts] + [c for c in sched.prefills if c.length == 1]
    prefills = [c for c in sched.decodes if c.drafts] + [c for c in sched.prefills if c.length > 1]
    before: list[tuple] = []
    positions = [c.start for c in decodes]
    ids, slots, lens = decode_rows([c.request for c in decodes], positions, bs)
    for row, c in enumerate(decodes):
        _mark(c, row, logits_at, sampled, before)
        _mark_prompt(c, row, prompt_at, prompt_rows)
    width = max((-(-n // bs) for n in lens), default=0)
    table = [c.request.blocks[: -(-n // bs)] + [0] * (width - (-(-n // bs))) for c, n in zip(decodes, lens)]
    segments, tables = [], []
    for c in prefills:
        req, length = c.request, c.length + len(c.drafts)
        start = len(ids)
        ids.extend(req.tokens(c.start, c.start + c.length))
        ids.extend(c.drafts)
        span = range(c.start, c.start + length)
        positions.extend(span)
        slots.extend(req.blocks[p // bs] * bs + p % bs for p in span)
        tables.append(tuple(req.blocks[: -(-(c.start + length) // bs)]))
        segments.append(PrefillSegment(start, length, c.start))
        if c.drafts:
            for j in range(length):  # every position of a verified draft is sampled
                logits_at.append(start + j)
                sampled.append(req)
                before.append(c.drafts[:j])
        else:
            _mark(c, len(ids) - 1, logits_at, sampled, before)
        _mark_prompt(c, start, prompt_at, prompt_rows)
    batch = StepBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        slots=torch.tensor(slots, device=device),
        num_decode=len(decodes),
        decode_block_table=torch.tensor(table, dtype=torch.long, device=device).view(len(decodes), width),
        decode_context_lens=torch.tensor(lens, dtype=torch.long, device=device),
        prefills=tuple(segments),
        logits_indices=torch.tensor(logits_at + prompt_at, dtype=torch.long, device=device),
        prefill_tables=tuple(tables),
    )
    return batch, sampled, prompt_rows, before


def _mark(chunk, index: int, logits_at: list[int], sampled: list, before: list) -> None:
    """A chunk that computes its request's last token has that token's logits sampled."""
    if chunk.completes:
        logits_at.append(index)
        sampled.append(chunk.request)
        before.append(())


def _mark_prompt(chunk, first: int, prompt_at: list[int], prompt_rows: list) -> None:
    """Positions of this chunk (its first at flat index `first`) whose logits score the next prompt token."""
    req = chunk.request
    if req.prompt_logprobs is None:
        return
    for p in range(chunk.start, min(chunk.start + chunk.length, len(req.prompt_ids) - 1)):
        prompt_at.append(first + p - chunk.start)
        prompt_rows.append((req, p))
