"""Loading the model for a runner: whole on one device, or under tensor parallelism this rank's shard with the
other ranks started and loading theirs."""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.kernels.pages import HugePageMover, release_free_heap
from nanoserve.model.fused import fused_kernels
from nanoserve.model.loader import LoadedModel, load_model, peek_config
from nanoserve.model.quant.read_ahead import install_read_ahead
from nanoserve.parallel.driver import ParallelGroup
from nanoserve.parallel.shard import check_divisible


def load(config: EngineConfig, device, progress: Callable[[str], None]) -> tuple[LoadedModel, ParallelGroup | None]:
    """The loaded model and, with --tensor-parallel-size above 1, the group of ranks it is spread over. A size
    that does not divide the model is refused before any process starts. On the CPU the model runs on the fused
    kernels where it can (nanoserve/model/fused.py), its 4-bit linears packed for them as they load."""
    if config.fused_cpu_kernels and device.type == "cpu":
        progress("fused CPU kernels")  # built on a machine's first start (about two seconds), then cached
    if config.tensor_parallel_size == 1:
        progress("loading weights")
        return load_part(config, device), None
    shapes = peek_config(config.model)
    check_divisible(shapes, config.tensor_parallel_size)
    progress(f"starting {config.tensor_parallel_size} tensor-parallel ranks")
    group = ParallelGroup(config, device, shapes.hidden_size, shapes.vocab_size)
    progress("loading weights (every rank its shard)")
    try:
        with group.own_threads():
            loaded = load_part(config, device, group.shard, group.group)
    except Exception as e:
        group.confirm(f"{type(e).__name__}: {e}", "load")  # stops the other ranks, then raises
        raise
    group.confirm(None, "load")
    return loaded, group


def load_part(config: EngineConfig, device, shard=None, group=None) -> LoadedModel:
    """The model, or under tensor parallelism one rank's shard of it (every rank loads through here): on the
    fused CPU kernels where it can run them, its 4-bit linears packed for them as they load."""
    kernels, no_kernels = fused_kernels(config.fused_cpu_kernels, device)
    loaded = load_model(config.model, config.torch_dtype, device, config.max_model_len, config.quantization,
                        shard=shard, invariant=config.batch_invariant, kernels=kernels, no_kernels=no_kernels,
                        group=group)
    fused = loaded.fused
    if fused is not None and fused.active:
        if config.read_ahead:
            fused.read_ahead_linears = install_read_ahead(loaded.model, fused.kernels)
        else:
            fused.read_ahead_off = "--no-read-ahead"
    if getattr(device, "type", device) == "cpu":
        release_free_heap()  # the load's transient copies, which the packed weights (own pages) do not reuse
        if fused is not None and fused.active:
            fused.huge_pages = HugePageMover(loaded.model).start()  # while the engine serves
    return loaded


def not_invariant_reason(config: EngineConfig, model, device) -> str | None:
    """Why this runner is not batch-invariant (the flag off, a kernel of this machine, 3+ ranks), or None.

    Two ranks sum their partial outputs exactly alike whatever the order (a + b = b + a); three or more go
    through the backend's ring, whose order for an element depends on the tensor's size."""
    if not config.batch_invariant:
        return "--no-batch-invariant"
    from nanoserve.invariance import report

    reason = report(model, device)
    if reason is None and config.tensor_parallel_size > 2:
        reason = (f"{config.tensor_parallel_size} ranks sum partial outputs in an order that depends on the "
                  "tensor's size (the backend's ring); 1 or 2 ranks hold it")
    return reason


def determinism_text(config: EngineConfig, reason: str | None) -> str:
    """What the header and /health say of determinism."""
    if reason is None:
        return "batch-invariant"
    if not config.batch_invariant:
        return "not batch-invariant (--no-batch-invariant)"
    return f"not batch-invariant here: {reason}"
