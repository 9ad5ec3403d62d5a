"""The server `nanoserve bench soak` runs against, what it does to that server on purpose, and its account.

One engine in this process (its forward fails one call in N on purpose, and it is restarted with new flags
half-way), or `--data-parallel-size N` replicas behind this process's front end (a replica is SIGKILLed every
`--kill-every` seconds, as a crash would end it, and must rejoin). Either way the server wants an API key and
trusts request chat templates, so the hostile callers' attacks (bench/attacks.py) reach everything they can.
Resident memory is the server's whole: this process and, under data parallelism, every replica's.
"""

from __future__ import annotations

import secrets
import time

from nanoserve.bench.attacks import Target
from nanoserve.bench.memory import resident_mib, trimmed_resident_mib


class FaultInjector:
    """Wraps the engine's forward: every Nth call raises, as a kernel fault would (0: never)."""

    def __init__(self, every: int):
        self.every, self.calls, self.injected = every, 0, 0

    def install(self, engine) -> None:
        if not self.every:
            return
        real = engine.runner.model.forward

        def forward(*args, **kwargs):
            self.calls += 1
            if self.calls % self.every == 0:
                self.injected += 1
                raise RuntimeError("injected fault (bench soak --fault-every)")
            return real(*args, **kwargs)

        engine.runner.model.forward = forward


class SoakServer:
    """A live keyed server for the soak, single or data-parallel, and the disruptions it suffers."""

    def __init__(self, config, args):
        from nanoserve.server.serve import DataParallel, Server

        self.args = args
        self.parallel = args.data_parallel_size > 1
        data_parallel = DataParallel(args.data_parallel_size, args.data_parallel_backend, args.ray_address,
                                     args.data_parallel_routing) if self.parallel else None
        self.key = secrets.token_urlsafe(16)
        self.server = Server(config, port=0, api_key=self.key, trust_request_chat_template=True,
                             served_model_name=None, data_parallel=data_parallel).start()
        self.faults = FaultInjector(0 if self.parallel else args.fault_every)
        if not self.parallel:
            self.faults.install(self.server.host.engine)
        self.restart_s: float | None = None
        self.kills = 0

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def host(self):
        return self.server.host

    def target(self) -> Target:
        return Target(self.url, self.key, self.server, trusts_templates=True)

    @property
    def max_model_len(self) -> int:
        return self.host.serving().max_model_len if self.parallel else self.host.engine.max_model_len

    # ---- what the soak does to it --------------------------------------------------------------------------
    def restart(self) -> None:
        """One engine: a restart with --restart-flags (its requests are dropped, 503s meanwhile)."""
        from nanoserve.ab import variant

        new = variant(self.host.engine.config, self.args.restart_flags.replace(",", " "))
        started = time.monotonic()
        self.host.restart(new)
        self.faults.install(self.host.engine)
        self.restart_s = time.monotonic() - started

    def kill_replica(self) -> None:
        """Data parallel: SIGKILL the next replica in turn, as a crash or the OOM killer would."""
        rank = self.kills % self.args.data_parallel_size
        self.host.launcher.kill(rank)
        self.kills += 1

    def resident_mib(self) -> float | None:
        """This process's memory (after glibc hands back free arenas) plus every replica's; None while a replica
        is down or loading (its memory is on its way back, not a figure to hold the run to)."""
        if not self._all_ready():
            return None
        total = trimmed_resident_mib()
        if self.parallel:
            total += sum(resident_mib(link.pid) for link in self.host.links if link.pid)
        return total

    # ---- its account at the end ----------------------------------------------------------------------------
    def settle(self, seconds: float = 240.0) -> None:
        """Wait for the requests to drain and, under data parallelism, for every replica to be ready again."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and (self.host.live_requests() or not self._all_ready()):
            time.sleep(0.1)
        time.sleep(0.5)  # the replicas' latest Status (every 0.1 s) after their last request ended

    def _all_ready(self) -> bool:
        return not self.parallel or all(link.status == "ready" for link in self.host.links)

    def account(self) -> dict:
        """Blocks held, the host's request accounting, and what the engine(s) still keep per request."""
        stats = self.host.stats()
        leftovers = {"running": stats.scheduler.running, "waiting": stats.scheduler.waiting}
        if not self.parallel:
            leftovers.update(self.host.engine.output_processor.leftovers())
        return {"blocks_held_at_end": stats.kv.blocks_total - stats.kv.blocks_free, "host": self.host.accounting(),
                "engine_leftovers": leftovers, "replicas_ready": None if not self.parallel else
                sum(link.status == "ready" for link in self.host.links)}

    def stop(self) -> None:
        self.server.stop()
