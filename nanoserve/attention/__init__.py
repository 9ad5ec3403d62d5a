"""Every attention path, and the rule they answer to.

The seam: `step.AttentionStep` is one step's attention, built once a step by `dispatch.PagedRead.step`, which
every layer calls with its own queries (`store` its k and v, then `attend`); the step owns the KV cache's layout
and each path's metadata. The paths: `dispatch.PagedRead` decides how a step's decode rows read their context
and counts every read;
`gathered` (blocks gathered into one tensor, then sdpa), `streamed` (a Triton kernel walking the blocks in
tiles with an online softmax, split over the context on a GPU) and `tiled` (its torch twin on the CPU) are the
reads; `prefill` attends a prefill chunk to the cached past and to itself (two sdpa calls merged by log-sum-exp,
or one masked call); `invariant` is the batch-invariant path; `sdpa` is torch's attention on every version.

The determinism rule, written once here: **a query's output depends on its own context only.** The same position
of the same sequence gets the same reduction, in the same order, whether it is a decode row alone or in a crowd,
a token of a prefill chunk of any length, served from the prefix cache or computed, before or after a preemption.
Under `--batch-invariant` (the default) every query goes through `invariant.InvariantStep`, which holds it by
construction (fixed 64-key tiles summed in order, row counts padded to the multiple the machine's BLAS computes
independently; see invariant.py); the other paths are faster for some shapes but let the reduction follow the
batch, and `--no-batch-invariant` is what chooses them. A new path either holds the rule or is refused beside
`--batch-invariant` with the reason (as the streamed read is).
"""
