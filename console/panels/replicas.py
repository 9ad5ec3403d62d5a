"""The Replicas panel: a data-parallel server's replicas, one line each: status, process (or Ray actor), requests
in flight, running and waiting, KV use, requests served, how many of the prompt blocks routed to it it already
held (the prefix-affinity hit rate), and restarts. Shown only by a server that publishes `data_parallel`; a single
engine has no replicas to list, so its absence is not a feature switched off."""

from __future__ import annotations

from console.numbers import count
from console.panels.features import FeaturePanel
from nanoserve.stats import EngineStats

HEADER = f"{'rank':<5}{'status':<11}{'process':<14}{'flight':>7}{'run':>5}{'wait':>5}{'KV':>6}{'served':>8}" \
         f"{'hits':>6}{'restarts':>9}"


def _process(replica: dict) -> str:
    if replica.get("actor_id"):
        return f"actor {replica['actor_id'][:8]}"
    return f"pid {replica['pid']}" if replica.get("pid") else "-"


def _hits(replica: dict) -> str:
    blocks = replica.get("routed_prefix_blocks") or 0
    return f"{round(100 * replica.get('routed_prefix_blocks_matched', 0) / blocks)}%" if blocks else "-"


def replica_line(replica: dict) -> str:
    kv = f"{round(100 * replica.get('kv_cache_usage', 0.0))}%"
    return (f"{replica['rank']:<5}{replica['status']:<11}{_process(replica):<14}{count(replica['in_flight']):>7}"
            f"{count(replica['running']):>5}{count(replica['waiting']):>5}{kv:>6}"
            f"{count(replica['requests_served']):>8}{_hits(replica):>6}{count(replica['restarts']):>9}")


def replicas_text(dp: dict) -> str:
    head = (f"{dp['backend']} · {dp['routing']} · {dp['replicas_ready']} of {dp['size']} ready")
    lines = [head, HEADER, *(replica_line(r) for r in dp["replicas"])]
    lines += [f"  {r['rank']}: {r['reason']}" for r in dp["replicas"] if r.get("reason")]
    return "\n".join(lines)


class ReplicasPanel(FeaturePanel):
    def __init__(self, **kwargs):
        super().__init__("data_parallel", **kwargs)

    def show(self, stats: EngineStats) -> None:
        dp = stats.features.get("data_parallel")
        self.published = isinstance(dp, dict)
        if self.published:
            self.set_text(replicas_text(dp))
