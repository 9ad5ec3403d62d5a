"""TensorGroup: one rank's place in a tensor-parallel group on torch.distributed, and the collectives it runs.

The backend follows the device (NCCL between GPUs, gloo between CPU processes); the rendezvous is a TCP address
on loopback when every rank runs on this machine, or `--distributed-init` (`env://` with MASTER_ADDR and
MASTER_PORT, torch's convention, or `tcp://host:port`) across machines. Rank 0 hosts the group's TCPStore.

The group is a process group object of its own (ProcessGroupGloo / ProcessGroupNCCL over its own store), not
torch's process-wide default group: two engines in one process (an A/B run, a restart, two LLMs in a script)
each keep their own. Start-up words (the flags, each rank's status) go through the store; each step's batch
and every tensor collective go through the process group. Every wait has the group's timeout, so a rank that
stops answering ends it with an error instead of a hang; a rank that dies closes its sockets, and gloo raises
at once.

The time spent in collectives is counted (host wall time: exact on gloo, which is synchronous; on NCCL it is the
time to enqueue) so the stats can say what parallelism costs per step.

Every value a rank unpickles, and every failure report, is signed with the group's key (sealed.py): the store
answers anyone who reaches its port, so an unsigned value is refused unread.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from nanoserve.parallel.sealed import seal, unseal
from nanoserve.parallel.shm import SharedReduce

FAILED_KEY = "failed/{rank}"  # where a rank that fails writes why, in the group's store
POLL_S = 0.05
STARTUP_S = 120.0  # the least a start-up phase waits for the other ranks, whatever --distributed-timeout says
STARTUP_PHASES = ("load", "KV pool")  # phases in which a rank imports, loads and probes: slow, not hung
MESSAGE_BYTES = 64 * 1024  # one broadcast carries a step's message up to this size


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_loopback_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rendezvous(init_method: str) -> tuple[str, int]:
    """(host, port) of rank 0's store: tcp://host:port, or env:// read from MASTER_ADDR and MASTER_PORT."""
    if init_method.startswith("env://"):
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("--distributed-init env:// reads MASTER_ADDR and MASTER_PORT, and they are not set; "
                             "export them on every machine (rank 0's address and a free port)")
        return host, int(port)
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed_init {init_method!r} is not env:// or tcp://host:port")
    return url.hostname, url.port


class GroupFailed(RuntimeError):
    """A start-up wait ended without every rank (one died, or the timeout passed)."""


class TensorGroup:
    """`rank` of `world` in a group of its own. `alive` (rank 0) names a local rank that has died, so a wait for
    the ranks ends at once instead of at the timeout."""

    def __init__(self, rank: int, world: int, init_method: str, device: torch.device, timeout_s: float,
                 key: bytes, alive: Callable[[], str | None] | None = None):
        self.rank, self.world, self.device, self.key = rank, world, device, key
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.alive = alive or (lambda: None)
        host, port = rendezvous(init_method)
        self.store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        self.store.set(f"joined/{rank}", "1")
        self.wait([f"joined/{r}" for r in range(world)], "every rank to join", floor_s=STARTUP_S)
        self.pg = self._process_group()
        self.shared: SharedReduce | None = None  # same-machine CPU ranks: all-reduces through shared memory
        self.collective_s = 0.0  # seconds spent in collectives, since the start
        self.collectives = 0
        self.seconds_by_kind: dict[str, float] = {}  # all_reduce, gather, broadcast
        self.by_path: dict[str, dict[str, int]] = {"all_reduce": {}, "gather": {}}  # kind -> path -> count

    def share_memory(self, path: str, capacity: int, gather_capacity: int = 0) -> None:
        """All-reduces of up to `capacity` floats, and logits gathers of up to `gather_capacity` a rank, through
        the shared file at `path` (rank 0 creates it)."""
        parent = os.getppid()
        alive = self.alive if self.rank == 0 else \
            (lambda: "rank 0 is gone" if os.getppid() != parent else None)
        self.shared = SharedReduce(path, self.rank, self.world, capacity, self.timeout.total_seconds(), alive,
                                   gather_capacity)

    def _process_group(self):
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(self.store, self.rank, self.world, options)
        return dist.ProcessGroupGloo(self.store, self.rank, self.world, self.timeout)

    # ---- start-up words through the store -----------------------------------------------------------
    def wait(self, keys: list[str], what: str, floor_s: float = 0.0) -> None:
        """Until every key is set; GroupFailed at once when a rank has failed, or after the timeout (at least
        `floor_s`: start-up phases wait for a process to import torch and load, which is not a hang)."""
        waited = max(self.timeout.total_seconds(), floor_s)
        deadline = time.monotonic() + waited
        while not self.store.check(keys):
            failed = self.alive() or self.reported_failure()
            if failed:
                raise GroupFailed(failed)
            if time.monotonic() > deadline:
                raise GroupFailed(f"waited {waited:g} s for {what}; is every rank started with the same "
                                  "--distributed-init and NANOSERVE_DISTRIBUTED_KEY?")
            time.sleep(POLL_S)

    def put(self, key: str, value) -> None:
        self.store.set(key, seal(self.key, key, pickle.dumps(value)))

    def take(self, key: str, what: str, floor_s: float = 0.0):
        """The value at `key` once set; Unauthenticated (unread) when it is not signed with the group's key."""
        self.wait([key], what, floor_s)
        return pickle.loads(unseal(self.key, key, self.store.get(key)))

    def gather_status(self, phase: str, status) -> list:
        """Each rank's word after a phase (a str: what went wrong; anything else: fine, and what it reports),
        collected on rank 0 (an empty list elsewhere)."""
        self.put(f"{phase}/{self.rank}", status)
        if self.rank:
            return []
        floor = STARTUP_S if phase in STARTUP_PHASES else 0.0
        return [self.take(f"{phase}/{r}", f"rank {r} to finish {phase}", floor) for r in range(self.world)]

    # ---- the sharded model's collectives ------------------------------------------------------------
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's partial outputs across ranks. On the CPU in float32 (a packed
        projection answers in bfloat16, and the residual stream it joins is float32 there)."""
        if x.device.type == "cpu" and x.dtype != torch.float32:
            x = x.float()
        started = time.perf_counter()
        if self.shared is not None and self.shared.fits(x):
            self.shared.all_reduce(x)
            self._took("all_reduce", "shared memory")
        else:
            self.pg.allreduce([x]).wait()
            self._took("all_reduce", backend_for(self.device))
        self._count(started, "all_reduce")
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor, start: int) -> torch.Tensor:
        """A vocabulary-parallel lookup: each rank embeds the ids in its slice, zeros the rest, and the sum
        across ranks is every row's embedding."""
        local = ids - start
        outside = (local < 0) | (local >= embedding.num_embeddings)
        x = embedding(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.reduce(x)

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Every rank's vocabulary slice of the logits, joined on rank 0 (None elsewhere), padding dropped."""
        local = local.contiguous()
        if self.shared is not None and self.shared.gathers(local):
            started = time.perf_counter()
            joined = self.shared.gather(local)
            self._took("gather", "shared memory")
            self._count(started, "gather")
            return joined[..., :vocab] if joined is not None else None
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        started = time.perf_counter()
        self.pg.gather([parts] if parts is not None else [], [local], options).wait()
        self._took("gather", backend_for(self.device))
        self._count(started, "gather")
        return torch.cat(parts, dim=-1)[..., :vocab] if parts is not None else None

    # ---- each step's message from rank 0 ------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: one object to every rank, pickled. A broadcast costs its latency more than its bytes, so a
        step's message goes in one fixed-size broadcast (its length in the first 8 bytes), and only a message
        larger than that takes a second one for the rest."""
        data = seal(self.key, "step", pickle.dumps(message))
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = min(len(data), MESSAGE_BYTES - 8)
        head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        started = time.perf_counter()
        self._broadcast(head)
        if len(data) > first:
            self._broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8))
        self._count(started, "broadcast")

    def receive(self):
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self._broadcast(head)
        size = int(head[:8].view(torch.int64).item())
        first = min(size, MESSAGE_BYTES - 8)
        data = head[8:8 + first].numpy().tobytes()
        if size > first:
            rest = torch.empty(size - first, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(unseal(self.key, "step", data))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        on = tensor if self.device.type == "cpu" else tensor.to(self.device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([on], options).wait()
        if on is not tensor:
            tensor.copy_(on.cpu())

    def _took(self, kind: str, path: str) -> None:
        """Which way this collective went (counted as it happens: a wide gather leaves the shared buffer)."""
        counts = self.by_path[kind]
        counts[path] = counts.get(path, 0) + 1

    def _count(self, started: float, kind: str) -> None:
        seconds = time.perf_counter() - started
        self.collective_s += seconds
        self.collectives += 1
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + seconds

    # ---- faults -------------------------------------------------------------------------------------
    def report_failure(self, error: BaseException) -> None:
        """A worker's last act: write why it failed where rank 0 can read it, even from another machine."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        key = FAILED_KEY.format(rank=self.rank)
        try:
            self.store.set(key, seal(self.key, key, text.encode()))
        except Exception:  # the store itself is gone: rank 0 still sees the rank leave
            pass

    def failure_of(self, rank: int) -> str | None:
        """What rank `rank` wrote before it failed, if it could (an unsigned report is not its word: None)."""
        key = FAILED_KEY.format(rank=rank)
        try:
            return unseal(self.key, key, self.store.get(key)).decode() if self.store.check([key]) else None
        except Exception:  # the store is gone, or the report is unsigned (Unauthenticated)
            return None

    def reported_failure(self) -> str | None:
        """The first other rank's own account of its failure, if one wrote it."""
        for rank in range(self.world):
            if rank != self.rank:
                why = self.failure_of(rank)
                if why:
                    return f"tensor-parallel rank {rank} failed: {why}"
        return None

    def close(self) -> None:
        """Drop the process group and the store (rank 0's store server goes with it)."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        self.pg = None
        self.store = None


def memory_of(model, cache) -> dict:
    """What one rank holds, measured: its weights' and KV pool's bytes, and the process's resident memory."""
    weights = sum(t.nbytes for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = None
    return {"weights_bytes": weights, "kv_bytes": cache.nbytes, "rss_bytes": rss}
