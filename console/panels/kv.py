"""The KV pool: blocks used/free/total, usage, the prefix cache, and the scheduler's preemptions."""

from __future__ import annotations

from console.panels.text import TextPanel
from nanoserve.stats import EngineStats


class KVPanel(TextPanel):
    def show(self, stats: EngineStats) -> None:
        kv, sched = stats.kv, stats.scheduler
        self.set_text(
            f"blocks used  {kv.blocks_used} / {kv.blocks_total}  (free {kv.blocks_free})\n"
            f"usage        {kv.usage:.1%}\n"
            f"block size   {kv.block_size} tokens, {kv.bytes / 2**20:.1f} MiB\n"
            f"{prefix_line(stats)}\n"
            f"preemptions  {sched.preemptions}\n"
            f"running      {sched.running}  waiting {sched.waiting}  peak {sched.peak_running}\n"
            f"generated    {sched.generation_tokens_total} tokens in {sched.steps} steps"
        )


def prefix_line(stats: EngineStats) -> str:
    """Hit rate over the tokens looked up; cached blocks (free ones kept for reuse) and evictions."""
    cache = stats.prefix_cache
    if not cache.enabled:
        return "prefix cache off"
    return (f"prefix hits  {cache.hit_rate:.1%} of {cache.queries:,} tokens\n"
            f"cached       {cache.cached_blocks:,} blocks ({cache.cached_free_blocks:,} free), "
            f"{cache.evictions:,} evicted")
