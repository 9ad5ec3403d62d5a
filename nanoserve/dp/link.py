"""The front end's side of one replica (ReplicaLink: its connection, status, load, snapshot and what /health
lists of it), a request it carries (LiveRequest), and what the routes read in place of an engine (FrontModel)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from nanoserve.dp import messages as m
from nanoserve.dp.routing import ReplicaView
from nanoserve.server.health import Health
from nanoserve.server.host import HostStopped
from nanoserve.stats import EngineStats


@dataclass
class ReplicaLink:
    """The front end's side of one replica."""

    rank: int
    view: ReplicaView
    status: str = "starting"  # starting | ready | restarting | failed | stopped
    reason: str | None = None
    conn: Connection | None = None
    pid: int | None = None
    node: str | None = None
    actor_id: str | None = None
    restarts: int = 0
    tries: int = 0  # restarts in a row without STEADY_S of service
    ready_since: float | None = None
    stats: EngineStats | None = None  # the latest Status's, with the finished rows last sent
    finished_rows: tuple = ()
    health: Health | None = None
    failed_steps_total: int = 0
    served: int = 0  # requests that ended with their final output
    ops: dict = field(default_factory=dict)  # call id -> Future
    sending: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message) -> None:
        conn = self.conn
        if conn is None:
            raise HostStopped(f"replica {self.rank} is {self.status}; retry")
        with self.sending:
            try:
                conn.send(message)
            except (OSError, EOFError, ValueError) as e:
                raise HostStopped(f"replica {self.rank} went away ({e}); retry") from None

    def take_status(self, status: m.Status) -> None:
        """The replica's latest snapshot, with its finished rows as last sent (a Status carries them only when
        they changed)."""
        if status.finished_rows is not None:
            self.finished_rows = status.finished_rows
        self.stats = replace(status.stats, finished_rows=self.finished_rows)
        self.health, self.failed_steps_total = status.health, status.failed_steps_total
        self.view.running = status.stats.scheduler.running
        self.view.kv_usage = status.stats.kv.usage

    def describe(self) -> dict:
        """Its line in /health's data_parallel.replicas."""
        s, prefix = self.stats, self.stats.prefix_cache if self.stats else None
        return {"rank": self.rank, "status": self.status, "reason": self.reason, "pid": self.pid, "node": self.node,
                "actor_id": self.actor_id, "restarts": self.restarts, "in_flight": self.view.in_flight,
                "running": s.scheduler.running if s else 0, "waiting": s.scheduler.waiting if s else 0,
                "kv_cache_usage": round(s.kv.usage, 4) if s else 0.0, "requests_served": self.served,
                "routed": self.view.routed, "routed_prefix_blocks": self.view.prompt_blocks,
                "routed_prefix_blocks_matched": self.view.matched_blocks, "cached_blocks_known": len(self.view.cached),
                "prefix_cache": {"queries": prefix.queries, "hits": prefix.hits, "cached_blocks": prefix.cached_blocks,
                                 "evictions": prefix.evictions} if prefix else None}


@dataclass
class LiveRequest:
    link: ReplicaLink
    sink: Callable
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class FrontModel:
    """What the routes read from `host.serving()`, as an Engine offers it, without the weights: the tokenizer,
    the model's config and limits, and a grammar compiler to check structured outputs up front."""

    def __init__(self, ready: m.Ready):
        from nanoserve.structured.grammars import Grammars

        self.name, self.tokenizer, self.model_config = ready.model_name, ready.tokenizer, ready.model_config
        self.max_model_len, self.ready = ready.max_model_len, ready
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids)

    def prompt_ids(self, prompt) -> list[int]:
        """The ids the replica's engine will see (text is tokenized as Admission does), for routing only."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)


class ReplicaFailures:
    """`host.failures` for /health: the replicas' failed steps, added up."""

    def __init__(self, links: list[ReplicaLink]):
        self._links = links

    @property
    def total(self) -> int:
        return sum(link.failed_steps_total for link in self._links)
