"""Which replica serves a request: the one whose prefix cache holds the longest run of the prompt's leading
blocks, among replicas not too far behind the least loaded; then the least loaded (waiting, then running, then
KV use); then the next in turn.

A replica's cached blocks are known exactly from its KV events (kv/events.py), the same stream KV-aware routers
subscribe to: BlockStored adds names, BlockRemoved takes them away, AllBlocksCleared empties the set. A prompt's
names are computed here as the replica's KVManager computes them (kv/prefix.py: the same chain, root and salt),
so a match here is a hit there, unless the block is evicted in between.

Affinity alone would send every request that shares a system prompt to one replica. So a replica is a candidate
for affinity only while it carries fewer than `imbalance` more requests than the least loaded one (a full batch
of rows by default): past that the others take requests, compute the prefix once each, and then share the load.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanoserve.kv.prefix import BlockNames, root_hash, sha256_block

POLICIES = ("prefix-affinity", "least-loaded", "round-robin")


def prompt_chain(ids: Sequence[int], block_size: int, root: bytes, cache_salt: str | None = None) -> list[bytes]:
    """The names of the prompt's full blocks that a replica could serve from its cache: all but the block holding
    the last token, which is always computed (KVManager.cached_prefix)."""
    root = root if cache_salt is None else root_hash(root, cache_salt)
    full = (len(ids) - 1) // block_size
    return BlockNames().extend(lambda a, b: list(ids[a:b]), full, block_size, root, sha256_block)


@dataclass
class ReplicaView:
    """What the router knows of one replica: whether it takes requests, its load and its cached block names."""

    rank: int
    ready: bool = False
    in_flight: int = 0  # requests routed here and not yet finished (the front end's own count: no lag)
    running: int = 0  # from its latest status report
    kv_usage: float = 0.0
    cached: set = field(default_factory=set)  # block names, from its KV events
    routed: int = 0  # requests sent here, ever
    matched_blocks: int = 0  # of the blocks those requests' prompts had, the ones this replica held when routed
    prompt_blocks: int = 0

    def apply(self, events) -> None:
        """Replay a batch of KV events onto the cached set."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self.cached.update(event.block_hashes)
            elif kind == "BlockRemoved":
                self.cached.difference_update(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self.cached.clear()

    def matched(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of `chain` this replica holds."""
        n = 0
        for name in chain:
            if name not in self.cached:
                break
            n += 1
        return n

    def load(self) -> tuple:
        """Waiting (what was routed beyond what runs), then running, then KV use: smaller is less loaded."""
        running = min(self.running, self.in_flight)
        return (self.in_flight - running, running, self.kv_usage)


class Router:
    def __init__(self, policy: str = "prefix-affinity", imbalance: int = 64):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.imbalance = policy, max(1, imbalance)
        self._turn = itertools.count()

    def pick(self, replicas: Sequence[ReplicaView], chain: Sequence[bytes]) -> ReplicaView | None:
        """The replica for a prompt whose block names are `chain`; None when none is ready. Counts the
        routing (and its match) on the replica picked."""
        ready = [r for r in replicas if r.ready]
        if not ready:
            return None
        turn = next(self._turn)
        if self.policy == "round-robin":
            chosen = ready[turn % len(ready)]
        else:
            chosen = self._best(ready, chain, turn)
        chosen.routed += 1
        chosen.prompt_blocks += len(chain)
        chosen.matched_blocks += chosen.matched(chain)
        return chosen

    def _best(self, ready: list[ReplicaView], chain: Sequence[bytes], turn: int) -> ReplicaView:
        def in_turn(r: ReplicaView) -> int:  # ties go round: an idle pair alternates instead of always rank 0
            return (r.rank - turn) % len(ready)

        if self.policy == "prefix-affinity" and chain:
            fewest = min(r.in_flight for r in ready)
            balanced = [r for r in ready if r.in_flight < fewest + self.imbalance]
            matches = {r.rank: r.matched(chain) for r in balanced}
            most = max(matches.values())
            if most > 0:
                ready = [r for r in balanced if matches[r.rank] == most]
        return min(ready, key=lambda r: (r.load(), in_turn(r)))
