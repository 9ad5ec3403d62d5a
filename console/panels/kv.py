"""The KV pool: blocks used/free/total, usage, the prefix cache, and the scheduler's preemptions."""

from __future__ import annotations

from console.numbers import count, size
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


class KVPanel(TextPanel):
    def show(self, stats: EngineStats) -> None:
        self.set_text(kv_text(stats))


def kv_text(stats: EngineStats) -> str:
    kv, sched = stats.kv, stats.scheduler
    return (
            f"blocks used  {count(kv.blocks_used)} / {count(kv.blocks_total)}  (free {count(kv.blocks_free)})\n"
            f"usage        {kv.usage:.1%}  ({count(kv.blocks_used * kv.block_size)} of "
            f"{count(kv.blocks_total * kv.block_size)} tokens)\n"
            f"block size   {kv.block_size} tokens; pool {size(kv.bytes)}\n"
            f"{prefix_line(stats)}\n"
            f"preemptions  {count(sched.preemptions)}\n"
            f"running      {count(sched.running)}  waiting {count(sched.waiting)}  peak {count(sched.peak_running)}\n"
            f"generated    {count(sched.generation_tokens_total)} tokens in {count(sched.steps)} steps"
    )


def prefix_line(stats: EngineStats) -> str:
    """Hit rate over the tokens looked up; cached blocks (free ones kept for reuse) and evictions."""
    cache = stats.prefix_cache
    if not cache.enabled:
        return "prefix cache off"
    return (f"prefix hits  {cache.hit_rate:.1%} of {cache.queries:,} tokens\n"
            f"cached       {cache.cached_blocks:,} blocks ({cache.cached_free_blocks:,} free), "
            f"{cache.evictions:,} evicted")
