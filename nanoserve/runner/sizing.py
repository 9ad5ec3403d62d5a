"""How big the KV pool is, and the context length it allows: measured at start-up, before the pool exists.

On CUDA the pool gets a fraction of the card less the weights, the peak of a warm-up step at the full token
budget and the graphs' pool (measured by capturing the largest shape on a scratch cache); on the CPU a fixed
budget unless --kv-cache-gib says otherwise.
"""

from __future__ import annotations

import gc
import logging

import torch

from nanoserve.attention.dispatch import PagedRead
from nanoserve.errors import ConfigError
from nanoserve.kv.cache import KVCache, blocks_from_budget, kv_layout
from nanoserve.model.batch import PrefillSegment, StepBatch

log = logging.getLogger("nanoserve.engine")

CPU_DEFAULT_KV_GIB = 1.0


def pool_blocks(runner) -> int:
    """KV blocks this rank's pool holds (its share of the kv heads)."""
    cfg = runner.config
    if cfg.kv_cache_gib is not None:
        budget = cfg.kv_cache_gib * 2**30
    elif runner.device.type == "cuda":
        budget = _cuda_kv_budget(runner)
    else:
        budget = CPU_DEFAULT_KV_GIB * 2**30
    return blocks_from_budget(runner.model.config, budget, cfg.block_size, runner.dtype)


def _cuda_kv_budget(runner) -> float:
    """A fraction of the card, less weights and the peak of a warm-up step at the full token budget."""
    device = runner.device
    torch.cuda.reset_peak_memory_stats(device)
    runner.progress("warming up")
    warm_up(runner)
    # memory an engine closed before this one left in torch's cache counts as used in mem_get_info: hand it
    # back first (a restart from the console, a second LLM in one script)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    graphs = _graph_reserve(runner)
    return (total * runner.config.gpu_memory_utilization - (total - free)
            - (peak - torch.cuda.memory_allocated(device)) - graphs)


def scratch_cache(runner) -> KVCache:
    """A two-block cache for measuring: the real pool does not exist yet."""
    cfg = runner.config
    return KVCache(runner.model.config, 2, cfg.block_size, runner.dtype, runner.device,
                   kv_layout(cfg, runner.model.fused is not None))


def warm_up(runner) -> None:
    """One step at the full token budget, so its peak memory can be measured before the KV pool is sized.

    The positions wrap at the rope table's length: --max-model-len below the token budget builds a shorter
    table, and indexing past it is a device-side assert on CUDA that poisons the process. The step's size,
    which is what sets its peak, is unchanged."""
    cfg, device = runner.config, runner.device
    n = min(cfg.max_num_batched_tokens, runner.model_config.max_position_embeddings)
    cache = scratch_cache(runner)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    positions = torch.arange(n, device=device) % runner.model.rope.cos.shape[0]
    batch = StepBatch(
        input_ids=ids, positions=positions, slots=ids % cfg.block_size,
        num_decode=0, decode_block_table=ids[:0, None], decode_context_lens=ids[:0],
        prefills=(PrefillSegment(0, n, 0),), logits_indices=ids[-1:],
        prefill_tables=((0,) * -(-n // cfg.block_size),),
    )
    with torch.inference_mode():
        runner.forward(batch, cache, PagedRead("gathered", invariant=cfg.batch_invariant))
    del cache


def _graph_reserve(runner) -> int:
    """Device bytes the captured graphs will hold, measured by capturing the largest shape on a scratch cache."""
    cfg, mc = runner.config, runner.model_config
    if not cfg.decode_switches()["capture"]:
        return 0
    runner.progress("measuring the CUDA-graph pool")
    longest = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    scratch = scratch_cache(runner)
    path, captured = runner.decode_fast_path(scratch, longest)
    captured.capture(shapes=[max(path.buckets.shapes)])
    reserve = captured.stats.pool_bytes
    del path, captured, scratch
    with torch.cuda.device(runner.device):  # empty_cache empties the current device's cache: name ours
        torch.cuda.empty_cache()
    return reserve


def resolve_max_model_len(wanted: int | None, model_len: int, capacity: int, window: int | None = None) -> int:
    """The context length: what was asked (checked against the model, its attention window and the pool), or all
    the pool holds up to what the model was trained for and its window.

    A sliding window is honoured by never letting a sequence outgrow it: within the window, attending to every
    earlier token (what nanoserve computes) is exactly the window's attention."""
    if window is not None and window < model_len:
        if wanted is not None and wanted > window:
            raise ConfigError(
                f"max_model_len {wanted} is past this model's sliding_window of {window} tokens: nanoserve attends "
                f"to every earlier token, which is the window's attention only within it; use --max-model-len "
                f"{window} or less")
        if wanted is None:
            log.warning("max_model_len capped at %d tokens: the model's sliding_window (attention past it is not "
                        "implemented)", window)
        model_len = window
    if wanted is not None:
        if wanted > model_len:
            raise ConfigError(
                f"max_model_len {wanted} exceeds the {model_len} positions this model was trained for; "
                f"use --max-model-len {model_len} or less"
            )
        if wanted > capacity:
            raise ConfigError(
                f"max_model_len {wanted} needs {wanted} KV slots but the pool holds {capacity}; "
                "raise --kv-cache-gib or lower --max-model-len"
            )
        return wanted
    if capacity < model_len:
        log.warning("max_model_len capped at %d tokens: the KV pool holds no more", capacity)
    return min(model_len, capacity)
