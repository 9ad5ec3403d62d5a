"""The head's shortlist rescored in float32: the logits a row's next token is chosen among, at full precision.

A packed or bfloat16 output head returns bfloat16 logits, whose step is 0.125 between 16 and 32: two tokens a tenth
apart in float32 can come out tied, and a tie goes to the lower id. On the default model that turns "The capital
of France is Paris." into "L'Étoile, ..." when the prompt's last row meets a different kernel. Where the head is
tied to a float32 embedding, the exact weight is already in memory, so the SHORTLIST highest bfloat16 logits of
each row are recomputed from it in float32: greedy choices and top logprobs are a float32 head's, the tail stays
bfloat16, and no byte of weight is added.

Each row is rescored alone (a top-k over its own logits, a dot product over the hidden size reduced per output),
so the result is batch-invariant like the head it corrects.
"""

from __future__ import annotations

import torch

SHORTLIST = 16  # the bfloat16 error is at most a step or two, far less than the gap to the 17th logit


def rescore_shortlist(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                      shortlist: int = SHORTLIST) -> torch.Tensor:
    """`logits` [rows, vocab] float32 from a coarse head, with each row's `shortlist` highest recomputed as
    `hidden` [rows, hidden] . `weight` [vocab, hidden] in `weight`'s dtype (a vocabulary-parallel rank passes
    its own slice of both)."""
    top = logits.topk(min(shortlist, logits.shape[-1]), dim=-1).indices
    exact = (weight[top] * hidden.to(weight.dtype)[:, None, :]).sum(-1)
    return logits.scatter(1, top, exact.to(logits.dtype))
