"""The sliding windows: latency p50 / p99 and finishes, aborts, errors and refusals per second over the last
10 s, 1 min and 5 min, as the snapshot publishes them (`windows`, and the server's `refusals`)."""

from __future__ import annotations

from console.numbers import count, decimal
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats

TITLES = {"10s": "10 s", "1m": "1 min", "5m": "5 min"}
WIDTH = 15


def recent_text(stats: EngineStats) -> str:
    windows = stats.features.get("windows") or {}
    if not windows:
        return ""
    names = [n for n in TITLES if n in windows]
    lines = [f"{'':<10}" + "".join(f"{TITLES[n]:>{WIDTH}}" for n in names)]
    for kind, label in (("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("step", "step ms")):
        cells = [f"{decimal(windows[n][f'{kind}_p50_ms'])} / {decimal(windows[n][f'{kind}_p99_ms'])}" for n in names]
        lines.append(f"{label:<10}" + "".join(f"{c:>{WIDTH}}" for c in cells))
    for label, pick in (("finished/s", lambda r: sum(r.values())), ("aborts/s", lambda r: r.get("abort", 0.0)),
                        ("errors/s", lambda r: r.get("error", 0.0))):
        cells = [decimal(pick(windows[n]["finished_per_s"]), 2) for n in names]
        lines.append(f"{label:<10}" + "".join(f"{c:>{WIDTH}}" for c in cells))
    refused = (stats.features.get("refusals") or {}).get("per_s")
    if refused:  # counted by the server's HTTP layer: an engine outside a server has none
        lines.append(f"{'refused/s':<10}" + "".join(f"{decimal(refused.get(n, 0.0), 2):>{WIDTH}}" for n in names))
    lines.append("latency p50 / p99 over each window; rates per second")
    lines.append(stall_line(stats))
    return "\n".join(lines)


def stall_line(stats: EngineStats) -> str:
    """The latest stall with what the engine carried then, or that there was none. Two kinds: a step over 3x
    the recent p99, and decode throughput under half its running median while the load did not lighten."""
    stalls = stats.features.get("stalls") or {}
    latest = (stalls.get("latest") or [None])[-1]
    if latest is None:
        return "no stall (no step over 3x the recent p99, no throughput drop)"
    counts = f"STALLS {count(stalls['stalls'])} slow steps, {count(stalls.get('throughput_drops', 0))} throughput drops"
    if latest.get("kind") == "throughput":
        what = (f"decode {decimal(latest['decode_tok_s'])} tok/s (median {decimal(latest['median_tok_s'])}) over "
                f"{decimal(latest['seconds'], 2)} s, {decimal(latest['decode_rows'])} decode rows a step")
    else:
        what = (f"step {decimal(latest['step_ms'])} ms (p99 {decimal(latest['p99_ms'])} ms), "
                f"{count(latest['decode_rows'])} decode rows")
    return (f"{counts}; last at {latest['at']}: {what}, {count(latest['prefill_tokens'])} prefill tokens, "
            f"{count(latest['preemptions'])} preemptions")


class RecentPanel(TextPanel):
    def show(self, stats: EngineStats) -> None:
        self.set_text(recent_text(stats) or "no activity yet")
        stalls = stats.features.get("stalls") or {}
        self.set_class(bool(stalls.get("stalls") or stalls.get("throughput_drops")), "stalled")
