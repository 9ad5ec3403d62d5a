"""The ranks other than 0: each joins the group, takes rank 0's flags, loads its shard, and then runs every step
rank 0 sends until it is told to stop.

A worker is a spawned process on this machine (one per rank, started by rank 0), or `nanoserve worker --rank R`
started by hand on another machine with the same `--distributed-init` and NANOSERVE_DISTRIBUTED_KEY. It holds no scheduler, sampler or
tokenizer use of its own: it runs its part of each forward and hands its slice of the logits to rank 0.
If anything fails, it writes why in the group's store (rank 0 names it in its error) and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from nanoserve.errors import ConfigError
from nanoserve.parallel.group import TensorGroup, memory_of
from nanoserve.parallel.sealed import group_key
from nanoserve.parallel.shard import TensorShard

log = logging.getLogger("nanoserve.worker")


@dataclasses.dataclass(frozen=True)
class Hello:
    """Rank 0's first message: the flags every rank loads with (so a worker needs no flags of its own)."""

    config: object  # EngineConfig
    threads: int  # CPU threads each rank computes with
    shared_path: str | None = None  # same-machine CPU ranks: the file their all-reduces go through
    shared_capacity: int = 0  # floats one all-reduce may carry through it
    gather_capacity: int = 0  # floats of logits one rank may hand rank 0 through it


@dataclasses.dataclass(frozen=True)
class Pool:
    """Build the KV pool: rank 0 sized it, every rank holds its own kv heads of the same blocks."""

    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward: the step's batch (on the CPU) and the number of blocks of the cache it runs on (a scratch
    cache of that size when it is not the pool's: the CUDA warm-up that measures a step's peak)."""

    batch: object  # StepBatch
    cache_blocks: int


STOP = "stop"


def device_for(config, rank: int) -> torch.device:
    device = config.torch_device()
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def batch_to(batch, device: torch.device, copy: bool = False):
    """A StepBatch with its tensors on `device` (a pickled tensor keeps its sender's device). `copy`: each tensor
    its own compact copy, so a view of a persistent buffer is sent as its rows, not the whole buffer."""
    if device.type == "cpu" and not copy:
        return batch

    def moved(obj):
        return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).to(device, copy=copy)
                                           for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor)})

    return moved(batch)


def serve(rank: int, world: int, init_method: str, timeout_s: float, key: bytes, device_type: str = "cpu",
          model_override: str | None = None) -> int:
    """A worker's whole life; returns its exit status."""
    if device_type == "cuda":  # NCCL wants each rank's device chosen before the group forms
        torch.cuda.set_device(rank % torch.cuda.device_count())
    group = TensorGroup(rank, world, init_method, torch.device(device_type), timeout_s, key)
    try:
        hello: Hello = group.take("hello", "rank 0's flags")
        if hello.shared_path is not None:
            group.share_memory(hello.shared_path, hello.shared_capacity, hello.gather_capacity)
        config = hello.config if model_override is None else dataclasses.replace(hello.config, model=model_override)
        device = device_for(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(hello.threads)
        loaded = load_shard(group, config, device)
        return 1 if loaded is None else run_steps(group, config, loaded, device)
    except Exception as e:
        log.exception("tensor-parallel rank %d failed", rank)
        group.report_failure(e)
        return 1
    finally:
        group.close()


def load_shard(group: TensorGroup, config, device: torch.device):
    """This rank's part of the model, or None when it did not load (rank 0 hears why)."""
    from nanoserve.runner.loading import load_part

    shard = TensorShard(group.rank, group.world)
    try:
        loaded = load_part(config, device, shard, group)
    except Exception as e:
        group.report_failure(e)
        group.gather_status("load", f"{type(e).__name__}: {e}")
        return None
    group.gather_status("load", None)
    return loaded


def run_steps(group: TensorGroup, config, loaded, device: torch.device) -> int:
    """Every message rank 0 sends, until STOP: build the KV pool, then run each step's forward."""
    from nanoserve.attention.dispatch import paged_read_for
    from nanoserve.kv.cache import KVCache, kv_layout

    model, vocab = loaded.model, loaded.config.vocab_size
    dtype = next(model.parameters()).dtype
    read = paged_read_for(config.streamed_read, config.read_block, device, config.batch_invariant)
    cache = None
    while True:
        message = group.receive()
        if message == STOP:
            return 0
        if isinstance(message, Pool):
            cache = KVCache(model.config, message.num_blocks, config.block_size, dtype, device,
                            kv_layout(config, model.fused is not None))
            group.gather_status("KV pool", memory_of(model, cache))
            continue
        step_cache = cache if cache is not None and cache.num_blocks == message.cache_blocks else \
            KVCache(model.config, message.cache_blocks, config.block_size, dtype, device,
                    kv_layout(config, model.fused is not None))  # the CUDA warm-up's
        with torch.inference_mode():
            logits = model(batch_to(message.batch, device), step_cache, read)
        group.gather_logits(logits.float(), vocab)


def spawned(rank: int, world: int, init_method: str, timeout_s: float, key: bytes, device_type: str) -> None:
    """The entry of a worker rank 0 spawned on this machine (`key` is the group's, rank 0's random one)."""
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    os._exit(serve(rank, world, init_method, timeout_s, key, device_type))


def main(argv: list[str] | None = None) -> int:
    """`nanoserve worker`: one rank of a group whose rank 0 runs on another machine (`--distributed-init`).
    Every rank, rank 0 included, exports the same secret in NANOSERVE_DISTRIBUTED_KEY."""
    import argparse

    p = argparse.ArgumentParser(prog="nanoserve worker", description=main.__doc__)
    p.add_argument("--rank", type=int, required=True, help="this process's rank (1 .. N-1; rank 0 serves)")
    p.add_argument("--tensor-parallel-size", type=int, required=True, help="N, the whole group's size")
    p.add_argument("--distributed-init", default="env://",
                   help="the rendezvous rank 0 uses: env:// (MASTER_ADDR, MASTER_PORT) or tcp://host:port")
    p.add_argument("--distributed-timeout", type=float, default=60.0, help="seconds a collective may wait")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where this rank computes: rank 0's device (gloo between CPUs, NCCL between GPUs)")
    p.add_argument("--model", default=None, help="the model's path on this machine, when it differs from rank 0's")
    args = p.parse_args(argv)
    if not 1 <= args.rank < args.tensor_parallel_size:
        p.error(f"--rank must be in 1..{args.tensor_parallel_size - 1} (rank 0 is the serving process)")
    try:
        key = group_key(args.distributed_init)
    except ConfigError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format=f"rank {args.rank}: %(levelname)s %(message)s")
    return serve(args.rank, args.tensor_parallel_size, args.distributed_init, args.distributed_timeout, key,
                 args.device, args.model)


if __name__ == "__main__":
    sys.exit(main())
