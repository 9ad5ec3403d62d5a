"""Prompt and generation tokens/s, from successive snapshots of the engine's token counters."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from console.numbers import by_reason, count, decimal
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats

HISTORY = 60  # sparkline points (one per sample)


class TokenRates:
    """Rolling window of (time, prompt_total, generation_total); rates are differences of published counters."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()
        self.prompt_history: deque[float] = deque([0.0], maxlen=HISTORY)
        self.generation_history: deque[float] = deque([0.0], maxlen=HISTORY)

    def add(self, now: float, stats: EngineStats) -> None:
        if self.samples and now <= self.samples[-1][0]:
            return  # the same snapshot again (an attached server polled slower than the screen refreshes)
        sample = (now, stats.scheduler.prompt_tokens_total, stats.scheduler.generation_tokens_total)
        if self.samples and (sample[1] < self.samples[-1][1] or sample[2] < self.samples[-1][2]):
            self.samples.clear()  # the engine was restarted: its counters began again
        if self.samples:
            t0, p0, g0 = self.samples[-1]
            self.prompt_history.append((sample[1] - p0) / (now - t0))
            self.generation_history.append((sample[2] - g0) / (now - t0))
        self.samples.append(sample)
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rates(self) -> tuple[float, float]:
        if len(self.samples) < 2:
            return 0.0, 0.0
        (t0, p0, g0), (t1, p1, g1) = self.samples[0], self.samples[-1]
        span = t1 - t0
        return ((p1 - p0) / span, (g1 - g0) / span) if span > 0 else (0.0, 0.0)


class ThroughputPanel(Vertical):
    """The rates and their sparklines; the dashboard adds a sample to `rates` every tick, shown or not."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rates = TokenRates()  # the dashboard swaps in the selected server's own when it watches several

    def compose(self) -> ComposeResult:
        yield TextPanel(id="throughput-text")
        yield Static("prompt tok/s", classes="spark-label")
        yield Sparkline(list(self.rates.prompt_history), id="prompt-spark")
        yield Static("generation tok/s", classes="spark-label")
        yield Sparkline(list(self.rates.generation_history), id="generation-spark")

    def show(self, stats: EngineStats) -> None:
        self.query_one("#throughput-text", TextPanel).set_text(throughput_text(stats, *self.rates.rates()))
        self.query_one("#prompt-spark", Sparkline).data = list(self.rates.prompt_history)
        self.query_one("#generation-spark", Sparkline).data = list(self.rates.generation_history)


def throughput_text(stats: EngineStats, prompt_rate: float, generation_rate: float) -> str:
    sched, lat = stats.scheduler, stats.latency
    return (
        f"prompt      {decimal(prompt_rate):>8} tok/s  total {count(sched.prompt_tokens_total)}\n"
        f"generation  {decimal(generation_rate):>8} tok/s  total {count(sched.generation_tokens_total)}\n"
        f"finished    {count(sum(sched.finished.values()))}  {by_reason(sched.finished)}\n"
        f"TTFT ms     p50 {_ms(lat.ttft_p50)}  p99 {_ms(lat.ttft_p99)}  (last {lat.window} requests)\n"
        f"TPOT ms     p50 {_ms(lat.tpot_p50)}  p99 {_ms(lat.tpot_p99)}\n"
        f"step ms     p50 {_ms(lat.step_p50)}  p99 {_ms(lat.step_p99)}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else decimal(seconds * 1000)
