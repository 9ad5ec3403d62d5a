"""llama.cpp serving several sequences at once, as llama-server's slots do: one context whose KV cache holds
every sequence, one `llama_decode` per step over a batch with one token of each sequence (the prompts first, in
one batch), greedy. llama-cpp-python's `Llama` runs one sequence at a time; its low-level bindings reach the same
batched decode llama-server runs, so `nanoserve bench sizes` compares concurrent streams with that, not with
requests served one after another.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np


def slots_tok_s(llm, prompts: list[list[int]], tokens: int, threads: int) -> float:
    """Total tok/s of `len(prompts)` sequences each generating `tokens` tokens (the prompts' evaluation
    included, as nanoserve's measure does) on a fresh context beside `llm`'s, sharing its loaded weights."""
    started = time.perf_counter()
    generate_in_slots(llm, prompts, tokens, threads)
    return len(prompts) * tokens / (time.perf_counter() - started)


def generate_in_slots(llm, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """Each prompt's `tokens` greedy tokens, every sequence decoded in one batch a step on a fresh context
    beside `llm`'s (its weights shared)."""
    import llama_cpp

    streams = len(prompts)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = streams * (max(map(len, prompts)) + tokens + 16)
    params.n_batch = params.n_ubatch = max(sum(map(len, prompts)), streams)
    params.n_seq_max = streams
    params.kv_unified = True  # one KV buffer for every slot, as llama-server's default
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if ctx is None:
        raise RuntimeError("llama.cpp could not create a context for the slots")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    try:
        return _generate(ctx, batch, prompts, tokens, llm.n_vocab())
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _generate(ctx, batch, prompts: list[list[int]], tokens: int, vocab: int) -> list[list[int]]:
    """Every prompt in one batch (the last position of each yields logits), then `tokens - 1` steps of one token
    per sequence; each step's token is the argmax of that sequence's logits. Returns each sequence's tokens."""
    entries = [(seq, pos, tok, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
    positions = [len(p) for p in prompts]
    made: list[list[int]] = [[] for _ in prompts]
    for step in range(tokens):
        _decode(ctx, batch, entries)
        outputs = [i for i, entry in enumerate(entries) if entry[3]]  # one a sequence, in sequence order
        nexts = [_argmax(ctx, i, vocab) for i in outputs]
        for seq, token in enumerate(nexts):
            made[seq].append(token)
        if step == tokens - 1:
            break
        entries = [(seq, positions[seq], nexts[seq], True) for seq in range(len(prompts))]
        positions = [p + 1 for p in positions]
    return made


def _decode(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
    import llama_cpp

    for i, (seq, pos, token, wants_logits) in enumerate(entries):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = wants_logits
    batch.n_tokens = len(entries)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed on the slots' batch")


def _argmax(ctx, output: int, vocab: int) -> int:
    """The argmax of the logits of the batch's `output`-th token (one that asked for logits)."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(ctx, output)
    return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(vocab,)).argmax())
