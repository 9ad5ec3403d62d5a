"""ParallelModel: rank 0's forward across a tensor-parallel group, called exactly where the engine calls its model.

Rank 0 is the engine's own process: it keeps the scheduler, sampler, detokenizer and server, and a shard of the
model like every rank. Each step it sends the batch to the other ranks (one broadcast), runs its own shard (the
row-parallel all-reduces happen inside, on every rank together), and gathers every rank's slice of the logits.

Faults: before each step the spawned workers are checked (a dead one is named with its exit status without
entering a collective); a collective that fails (a rank died mid-step: gloo raises at once when its sockets
close; one that hangs: the group's timeout) raises WorkerFailed naming the rank and what it wrote before it
failed. The group cannot be repaired, so the engine stops serving (see Engine.failed).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time

import torch

from nanoserve.errors import ConfigError, NanoserveError
from nanoserve.parallel import shm, worker
from nanoserve.parallel.group import GroupFailed, TensorGroup, backend_for, free_loopback_address, memory_of
from nanoserve.parallel.sealed import group_key
from nanoserve.parallel.shard import TensorShard

log = logging.getLogger("nanoserve.parallel")


class WorkerFailed(NanoserveError):
    """A rank of the tensor-parallel group failed; the group cannot go on."""


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker hands its process sys.stderr's file descriptor; inside a Textual app
    sys.stderr is a capture whose fileno() is -1, and spawning a rank then fails. Start the tracker (once a
    process) with the real stderr."""
    from multiprocessing import resource_tracker

    try:
        usable = sys.stderr.fileno() >= 0
    except Exception:
        usable = False
    if usable:
        resource_tracker.ensure_running()
        return
    captured, sys.stderr = sys.stderr, sys.__stderr__
    try:
        resource_tracker.ensure_running()
    finally:
        sys.stderr = captured


def cpu_budget() -> int:
    """The threads one rank alone would compute with (torch's count: OMP_NUM_THREADS, or the usable cores)."""
    return torch.get_num_threads()


def rank_threads(world: int) -> int:
    """CPU threads per rank: one rank's threads shared out, at least one each."""
    return max(1, cpu_budget() // world)


class ParallelGroup:
    """Rank 0's side of the group: the spawned workers (when all ranks run here) and the group itself."""

    def __init__(self, config, device: torch.device, hidden_size: int, vocab_size: int):
        """`hidden_size` and `vocab_size` size the shared buffer of same-machine CPU ranks: a step's hidden
        states, and a decode step's logits (wider gathers, prompt logprobs, go through gloo)."""
        self.world = config.tensor_parallel_size
        self.local = config.distributed_init is None  # every rank on this machine: rank 0 spawns the others
        key = group_key(config.distributed_init)  # before any process starts: a missing one is refused first
        init = config.distributed_init or free_loopback_address()
        self.processes: list[multiprocessing.Process] = []
        if self.local and device.type == "cpu" and self.world > cpu_budget():
            log.warning("%d tensor-parallel ranks on %d CPU threads: ranks will wait for a core, and the group is "
                        "likely slower than one rank", self.world, cpu_budget())
        if self.local:
            _start_resource_tracker()
            context = multiprocessing.get_context("spawn")
            for rank in range(1, self.world):
                process = context.Process(target=worker.spawned, name=f"nanoserve-rank-{rank}", daemon=True,
                                          args=(rank, self.world, init, config.distributed_timeout, key, device.type))
                process.start()
                self.processes.append(process)
        self.failed: str | None = None
        self.timeout_s = config.distributed_timeout
        self.memory: list = []
        self._closed = False
        try:
            self.group = TensorGroup(0, self.world, init, device, config.distributed_timeout, key,
                                     alive=self._dead_ranks)
        except Exception as e:
            self.kill()
            hint = (" (the ranks are spawned processes that import the main script: a script that starts "
                    "tensor parallelism must do it under `if __name__ == \"__main__\":`)") \
                if self.local and "exited with status" in str(e) else ""
            raise WorkerFailed(f"the tensor-parallel group did not form at {init}: {e}{hint}") from e
        atexit.register(self.close)
        self.threads = rank_threads(self.world) if device.type == "cpu" else 0
        self.shared_path = None
        capacity = config.max_num_batched_tokens * hidden_size
        gather = config.max_num_seqs * self.shard.vocab_rows(vocab_size)
        if config.tp_all_reduce == "auto" and self.local and device.type == "cpu" and shm.supported():
            self.shared_path = shm.new_path()
            self.group.share_memory(self.shared_path, capacity, gather)
        self.group.put("hello", worker.Hello(config, self.threads, self.shared_path, capacity, gather))

    @contextlib.contextmanager
    def own_threads(self):
        """Rank 0's share of the CPU cores while it computes its shard (loading included: the packed kernels'
        crossovers are timed at the threads they will run with); the process's own count is put back after,
        so the sampler and any other engine in the process keep theirs."""
        threads = torch.get_num_threads()
        if not self.threads or threads == self.threads:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @property
    def shard(self) -> TensorShard:
        return TensorShard(0, self.world)

    # ---- start-up -----------------------------------------------------------------------------------
    def confirm(self, own, phase: str) -> list:
        """Every rank's word after a phase (rank 0's is `own`); raise, after stopping the ranks, if any
        failed (its word is a str). Returns the words."""
        statuses = self.collective(lambda: self.group.gather_status(phase, own))
        self._unlink_shared()  # every rank has mapped it by now (they do before loading)
        failed = [(rank, why) for rank, why in enumerate(statuses) if isinstance(why, str)]
        if failed:
            self.close()
            shown = "; ".join(f"rank {rank}: {why}" for rank, why in failed)
            raise ConfigError(f"tensor-parallel {phase} failed on {len(failed)} of {self.world} ranks ({shown})")
        return statuses

    def _unlink_shared(self) -> None:
        if self.shared_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.shared_path)
            self.shared_path = None

    def build_pools(self, model, cache) -> None:
        """Every other rank builds its KV pool of the blocks rank 0 sized; each says what it holds."""
        self.collective(lambda: self.group.send(worker.Pool(cache.num_blocks)))
        self.memory = self.confirm(memory_of(model, cache), "KV pool")

    def stats(self, steps: int) -> dict:
        """The `parallel` section of the stats snapshot (rank 0's collectives; every rank's memory)."""
        g = self.group
        return {"world_size": self.world, "backend": backend_for(g.device),
                "all_reduces_by_path": dict(g.by_path["all_reduce"]), "gathers_by_path": dict(g.by_path["gather"]),
                "threads_per_rank": self.threads,
                "collectives": g.collectives, "collective_ms": round(1000 * g.collective_s, 1),
                "collective_ms_per_step": round(1000 * g.collective_s / steps, 3) if steps else None,
                "ms_per_step_by_kind": {kind: round(1000 * seconds / steps, 3) if steps else None
                                        for kind, seconds in sorted(g.seconds_by_kind.items())},
                "ranks": [{"rank": rank, **memory} for rank, memory in enumerate(self.memory)],
                "failed": self.failed}

    # ---- steps --------------------------------------------------------------------------------------
    def collective(self, fn):
        """Run one exchange with the group; a failure of any rank becomes WorkerFailed naming it."""
        if self.failed is not None:
            raise WorkerFailed(self.failed)
        dead = self._dead_ranks()
        if dead:
            self.failed = dead
            raise WorkerFailed(dead)
        try:
            return fn()
        except Exception as e:
            time.sleep(0.2)  # a rank that raised writes why before its sockets close: give it the moment
            if isinstance(e, GroupFailed):
                said = str(e)
            elif isinstance(e, shm.CollectiveTimeout) or "timed out" in str(e).lower():  # alive, not answering
                said = (f"a tensor-parallel collective waited {self.timeout_s:g} s (--distributed-timeout) for a "
                        f"rank that is alive but not answering (stopped or stuck): {e}")
            else:
                said = f"a tensor-parallel collective failed ({type(e).__name__}: {e})"
            self.failed = self._dead_ranks() or self.group.reported_failure() or said
            raise WorkerFailed(self.failed) from e

    def _dead_ranks(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                why = self.group.failure_of(rank) if getattr(self, "group", None) is not None else None
                code = process.exitcode
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                return f"tensor-parallel rank {rank} {how}" + (f": {why}" if why else "")
        return None

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the ranks to stop (those still there), then make sure every spawned one is gone."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.failed is None:
            try:
                self.group.send(worker.STOP)
            except Exception:
                pass
        for process in self.processes:
            process.join(5)
        self.kill()
        self._unlink_shared()
        self.group.close()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


class ParallelModel:
    """Called as the model is: (batch, cache, read) -> logits over the whole vocabulary, on rank 0."""

    def __init__(self, model, group: ParallelGroup, vocab: int):
        self.model, self.group, self.vocab = model, group, vocab

    def __call__(self, batch, cache, read) -> torch.Tensor:
        """On the CPU rank 0's shard runs on its share of the cores, as every rank does; the process's own
        thread count is put back after (the sampler, and any other engine in the process, keep theirs)."""
        group = self.group
        cpu_batch = worker.batch_to(batch, torch.device("cpu"), copy=True)

        def step():
            group.group.send(worker.Step(cpu_batch, cache.num_blocks))
            local = self.model(batch, cache, read)
            return group.group.gather_logits(local.float(), self.vocab)

        with group.own_threads():
            return group.collective(step)
