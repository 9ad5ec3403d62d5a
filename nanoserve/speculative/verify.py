"""Keeping the drafted tokens a step's own sampling agrees with.

A verified request's k drafts come back as k + 1 sampled rows, row j sampled at the draft's position j with the
drafts before it as its history: exactly the row a one-token step would sample there once those tokens were
chosen. Its logits are the same bits (the batch-invariant path computes a position alike in any chunk), and a
seeded row's draw is a function of (seed, position) alone, so row j's token is the token decoding one at a time
would pick. Draft j is kept while it equals that token; the first row that disagrees (or the row after the last
draft) gives one more token of its own. Greedy and seeded outputs are therefore byte-identical with speculation
on and off; an unseeded row draws each token from the target distribution given the tokens before it, so its
output keeps that distribution.
"""

from __future__ import annotations


def accept(sampled: list, before: list[tuple[int, ...]], token_ids: list[int], logprobs: list,
           drafts_of: dict[int, tuple[int, ...]]) -> tuple[list, list[int], list, dict[int, int]]:
    """(requests, tokens, logprobs) of the rows kept, in row order (a verified request's kept tokens in their
    order), and the drafts kept per request serial. `before[i]` is the drafts preceding row i's position;
    `drafts_of` each verified request's drafts."""
    kept_rows, kept_tokens, kept_logprobs, accepted = [], [], [], {}
    i = 0
    while i < len(sampled):
        req, drafts = sampled[i], drafts_of.get(sampled[i].serial, ())
        if not drafts:
            kept_rows.append(req), kept_tokens.append(token_ids[i]), kept_logprobs.append(logprobs[i])
            i += 1
            continue
        run = len(drafts) + 1
        if len(before[i]) != 0 or any(sampled[i + j] is not req for j in range(run)):
            raise RuntimeError(f"a verified request's {run} rows must come together, first row first")
        j = 0
        while True:
            kept_rows.append(req), kept_tokens.append(token_ids[i + j]), kept_logprobs.append(logprobs[i + j])
            if j == len(drafts) or token_ids[i + j] != drafts[j]:
                break
            j += 1
        accepted[req.serial] = j
        i += run
    return kept_rows, kept_tokens, kept_logprobs, accepted
