"""The sliding windows: latency p50 / p99 and finishes, aborts, errors and refusals per second over the last
10 s, 1 min and 5 min, as the snapshot publishes them (`windows`, and the server's `refusals`); then the step-time
budget (`step_budget`) and the latest stall (`stalls`), with how many requests it carried and the dashboard's key
that lists them."""

from __future__ import annotations

from console.numbers import count, decimal
from console.panels.text import TextPanel
from nanoserve.stats import EngineStats

TITLES = {"10s": "10 s", "1m": "1 min", "5m": "5 min"}
STALL_KEY = "t"  # the dashboard's key for the latest stall's requests in the Requests table


def latest_stall(stats: EngineStats | None) -> dict | None:
    """The latest stall StallWatch kept (a slow step or a throughput drop); None before any."""
    stalls = (stats.features.get("stalls") or {}) if stats is not None else {}
    return (stalls.get("latest") or [None])[-1]


def recent_text(stats: EngineStats, key: str | None = None) -> str:
    """The panel's text; `key` (the dashboard's) is named beside the latest stall's requests."""
    windows = stats.features.get("windows") or {}
    if not windows:
        return ""
    names = [n for n in TITLES if n in windows]
    rows = [["", *(TITLES[n] for n in names)]]
    for kind, label in (("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("step", "step ms")):
        rows.append([label, *(f"{decimal(windows[n][f'{kind}_p50_ms'])} / {decimal(windows[n][f'{kind}_p99_ms'])}"
                              for n in names)])
    for label, pick in (("finished/s", lambda r: sum(r.values())), ("aborts/s", lambda r: r.get("abort", 0.0)),
                        ("errors/s", lambda r: r.get("error", 0.0))):
        rows.append([label, *(decimal(pick(windows[n]["finished_per_s"]), 2) for n in names)])
    refused = (stats.features.get("refusals") or {}).get("per_s")
    if refused:  # counted by the server's HTTP layer: an engine outside a server has none
        rows.append(["refused/s", *(decimal(refused.get(n, 0.0), 2) for n in names)])
    lines = table(rows)
    lines.append("latency p50 / p99 over each window; rates per second")
    budget = budget_line(stats)
    if budget:
        lines.append(budget)
    lines.append(stall_line(stats, key))
    return "\n".join(lines)


def table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned lines: labels left, figures right, every column as wide as its widest cell and two
    spaces apart, so a wide figure ("320.8 / 2,547.3") never runs into its neighbour."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def budget_line(stats: EngineStats) -> str:
    """The step-time budget in force (a step's prefill share beside running streams) with the costs behind it,
    and the latest step that ran past it, with the prompt it was reading."""
    budget = stats.features.get("step_budget")
    if not budget:
        return ""
    if not budget["enabled"]:
        return "step budget off (--max-step-ms 0): prefill takes the token budget beside streams"
    costs = (f"decode step {decimal(budget['decode_step_ms'])} ms, prefill {decimal(budget['prefill_token_ms'], 2)} "
             f"ms/token" if budget["decode_step_ms"] is not None and budget["prefill_token_ms"] is not None
             else "costs not measured yet")
    line = (f"step budget {decimal(budget['target_ms'])} ms ({budget['mode']}): {costs}; "
            f"{count(budget['limited_steps'])} steps cut, {count(budget['steps_over_target'])} over")
    if budget.get("row_quantum", 1) > 1:
        line += f"; chunks fill {budget['row_quantum']}-row tiles"
    latest = (budget.get("latest_over") or [None])[-1]
    if latest is not None:
        line += (f"; last over at {latest['at']}: {decimal(latest['step_ms'])} ms reading "
                 f"{', '.join(latest['prefill_requests']) or 'no prompt'}")
    return line


def stall_line(stats: EngineStats, key: str | None = None) -> str:
    """The latest stall with what the engine carried then, or that there was none. Two kinds: a step over 3x
    the recent p99, and decode throughput under half its running median while the load did not lighten. Then
    how many requests were in it, and `key`, which lists them (a server older than this console names none)."""
    stalls = stats.features.get("stalls") or {}
    latest = latest_stall(stats)
    if latest is None:
        return f"no stall (no step over {stalls.get('factor', 3.0):g}x the recent p99, no throughput drop)"
    counts = f"STALLS {count(stalls['stalls'])} slow steps, {count(stalls.get('throughput_drops', 0))} throughput drops"
    if latest.get("kind") == "throughput":
        what = (f"decode {decimal(latest['decode_tok_s'])} tok/s (median {decimal(latest['median_tok_s'])}) over "
                f"{decimal(latest['seconds'], 2)} s, {decimal(latest['decode_rows'])} decode rows a step")
    else:
        what = (f"step {decimal(latest['step_ms'])} ms (p99 {decimal(latest['p99_ms'])} ms), "
                f"{count(latest['decode_rows'])} decode rows")
    prompts = latest.get("prefill_requests") or []
    reading = f" ({', '.join(prompts[:3])}{', ...' if len(prompts) > 3 else ''})" if prompts else ""
    line = (f"{counts}; last at {latest['at']}: {what}, {count(latest['prefill_tokens'])} prefill tokens{reading}, "
            f"{count(latest['preemptions'])} preemptions")
    return line + stall_requests(latest, key)


def stall_requests(latest: dict, key: str | None) -> str:
    """'; 3 requests in it (t: list them)', or nothing when the entry names no requests."""
    names = latest.get("requests")
    if names is None:
        return ""
    n = len(names)
    said = f"; {count(n)}{'+' if latest.get('requests_cut') else ''} request{'' if n == 1 else 's'} in it"
    return said + (f" ({key}: list them)" if key else "")


class RecentPanel(TextPanel):
    def show(self, stats: EngineStats) -> None:
        self.set_text(recent_text(stats, STALL_KEY) or "no activity yet")
        stalls = stats.features.get("stalls") or {}
        self.set_class(bool(stalls.get("stalls") or stalls.get("throughput_drops")), "stalled")
