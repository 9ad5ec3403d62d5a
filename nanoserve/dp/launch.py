"""Starting, stopping and killing replicas: as spawned processes on this machine (mp) or as Ray actors on an
existing Ray cluster (ray). Either way a replica connects back to the front end's listener (replica.py), so the
front end sees one kind of replica and notices a dead one the same way: its connection drops.

Each replica gets its share of the machine: on CPU the threads one engine would use, divided among the replicas
(at least one each); on CUDA one GPU each (mp: cuda:rank; Ray: one GPU per actor, which Ray makes its cuda:0).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import uuid

from nanoserve.errors import ConfigError

log = logging.getLogger("nanoserve.dp")

BACKENDS = ("mp", "ray")


def replica_shares(config, size: int) -> tuple[int, list[str | None]]:
    """(CPU threads per replica, or 0 to leave torch's default; each replica's device, None to keep the flag).
    ConfigError when CUDA replicas outnumber the GPUs."""
    import torch

    from nanoserve.parallel.driver import cpu_budget

    device = config.torch_device()
    if device.type == "cuda":
        if config.device.startswith("cuda:"):
            raise ConfigError(f"--device {config.device} names one GPU; with --data-parallel-size each replica "
                              "takes its own GPU: use --device cuda (or auto)")
        count = torch.cuda.device_count()
        if size > count:
            raise ConfigError(f"--data-parallel-size {size} needs {size} GPUs (one per replica), this machine has "
                              f"{count}; lower it, or use the ray backend across machines")
        return 0, [f"cuda:{rank}" for rank in range(size)]
    budget = cpu_budget()
    if size > budget:
        log.warning("%d replicas on %d CPU threads: each gets one thread, and they will wait for a core", size,
                    budget)
    return max(1, budget // size), [None] * size


class ProcessLauncher:
    """Replicas as spawned processes on this machine: the listener is on loopback, and the authkey reaches each
    replica as an argument of its process (through the spawn pipe, never the network)."""

    backend = "mp"
    listen_host = "127.0.0.1"

    def __init__(self, config, size: int, max_waiting: int | None):
        from nanoserve.parallel.driver import _start_resource_tracker

        self.threads, self.devices = replica_shares(config, size)
        self.config, self.max_waiting = config, max_waiting
        self._context = multiprocessing.get_context("spawn")
        self._processes: dict[int, multiprocessing.Process] = {}
        _start_resource_tracker()

    def start(self, rank: int, address, authkey: bytes) -> None:
        from nanoserve.dp import replica

        config = self.config
        if self.devices[rank] is not None:
            config = dataclasses.replace(config, device=self.devices[rank])
        process = self._context.Process(target=replica.spawned, name=f"nanoserve-replica-{rank}", daemon=True,
                                        args=(address, authkey, rank, config, self.threads, self.max_waiting))
        process.start()
        self._processes[rank] = process

    def running(self, rank: int) -> bool:
        """Whether the replica's process has been started and has not ended (start() returns after spawning)."""
        process = self._processes.get(rank)
        return process is not None and process.is_alive()

    def exited(self, rank: int) -> str | None:
        """How the replica's process ended, or None while it runs."""
        process = self._processes.get(rank)
        if process is None or process.is_alive():
            return None
        return f"exit code {process.exitcode}"

    def kill(self, rank: int) -> None:
        """SIGKILL the replica (what a crash looks like; the tests' fault)."""
        process = self._processes.get(rank)
        if process is not None and process.is_alive():
            process.kill()

    def reap(self, rank: int, timeout: float = 5.0) -> str:
        """Wait for a replica that is going (killing it after `timeout`); how it ended, in words."""
        process = self._processes.pop(rank, None)
        if process is None:
            return "not started"
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join(5)
        code = process.exitcode
        return f"exit code {code}" + (" (killed by a signal)" if code is not None and code < 0 else "")

    def stop_all(self, timeout: float = 10.0) -> None:
        for rank in list(self._processes):
            self.reap(rank, timeout)


class RayLauncher:
    """Replicas as Ray actors on an existing cluster (`ray start --head`, or --ray-address), one per GPU or per
    CPU share; the front end stays where `nanoserve serve` runs and listens on this node's address (the other
    nodes must reach it). The authkey reaches each actor as an argument of its `serve` call, over Ray's own
    channels: as private as the cluster's network (encrypted only with Ray's TLS), which must be private anyway,
    since Ray runs whatever job a caller that reaches it submits."""

    backend = "ray"

    def __init__(self, config, size: int, max_waiting: int | None, address: str | None = None):
        from nanoserve.optional import require

        ray = require("ray", "--data-parallel-backend ray")
        self._connected = not ray.is_initialized()  # this driver connected: it disconnects at the end
        if self._connected:
            try:
                ray.init(address=address or "auto", log_to_driver=False)
            except ConnectionError as e:
                raise ConfigError(f"no Ray cluster at {address or 'auto'} ({e}); start one with `ray start --head`, "
                                  "or pass --ray-address host:6379") from None
        self.ray, self.config, self.max_waiting, self.size = ray, config, max_waiting, size
        self.listen_host = ray.util.get_node_ip_address()
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.gpu = config.device != "cpu" and gpus > 0
        if self.gpu and gpus < size:
            raise ConfigError(f"--data-parallel-size {size} needs {size} GPUs on the Ray cluster, it has {gpus}")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.threads = 0 if self.gpu else max(1, cpus // size)
        self._actors: dict[int, object] = {}
        self._runs: dict[int, object] = {}
        self._tag = uuid.uuid4().hex[:8]

    def start(self, rank: int, address, authkey: bytes) -> None:
        from nanoserve.dp.replica import RayReplica

        resources = {"num_gpus": 1, "num_cpus": 1} if self.gpu else {"num_cpus": self.threads}
        actor_class = self.ray.remote(**resources)(RayReplica)
        actor = actor_class.options(name=f"nanoserve-replica-{rank}-{self._tag}", max_restarts=0).remote()
        config = dataclasses.replace(self.config, device="cuda") if self.gpu else self.config
        self._actors[rank] = actor
        self._runs[rank] = actor.serve.remote(address, authkey, rank, config, self.threads, self.max_waiting)

    def running(self, rank: int) -> bool:
        """Whether the replica's actor has been started and its run has not ended."""
        return rank in self._runs and self.exited(rank) is None

    def exited(self, rank: int) -> str | None:
        """How the actor's run ended, or None while it runs."""
        run = self._runs.get(rank)
        if run is None:
            return None
        done, _ = self.ray.wait([run], timeout=0)
        if not done:
            return None
        try:
            self.ray.get(run)
            return "the actor returned"
        except Exception as e:
            return f"the actor died ({type(e).__name__}: {str(e)[:200]})"

    def kill(self, rank: int) -> None:
        actor = self._actors.get(rank)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)

    def reap(self, rank: int, timeout: float = 5.0) -> str:
        actor, run = self._actors.pop(rank, None), self._runs.pop(rank, None)
        if actor is None:
            return "not started"
        try:
            self.ray.get(run, timeout=timeout)
            how = "the actor returned"
        except self.ray.exceptions.GetTimeoutError:
            how = f"the actor did not return within {timeout:g} s and was killed"
        except Exception as e:  # RayActorError: it died (killed, out of memory, its node lost)
            how = f"the actor died ({type(e).__name__})"
        self.ray.kill(actor, no_restart=True)
        return how

    def stop_all(self, timeout: float = 10.0) -> None:
        for rank in list(self._actors):
            self.reap(rank, timeout)
        if self._connected:
            self.ray.shutdown()


def launcher(backend: str, config, size: int, max_waiting: int | None, ray_address: str | None = None):
    if backend == "mp":
        if ray_address:
            raise ConfigError("--ray-address is for --data-parallel-backend ray")
        return ProcessLauncher(config, size, max_waiting)
    if backend == "ray":
        return RayLauncher(config, size, max_waiting, ray_address)
    raise ConfigError(f"--data-parallel-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
