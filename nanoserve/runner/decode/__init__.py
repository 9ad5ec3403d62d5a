"""The decode fast path: addressing planned before the forward, closed shapes, persistent inputs, row compaction.

Each precondition a replayed CUDA graph relies on is a gate here: a function that refuses, with the reason, a
plan or buffer that would make a replay read the wrong memory.
"""
