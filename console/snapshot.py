"""`nanoserve-console --once`: the dashboard as plain text, for scripts and bug reports.

The same panel texts the dashboard shows, from the same engine snapshots (two, `refresh` seconds apart, so the
token rates are differences of published counters as on the screen), each under its title; the requests as a
plain table; features the engine does not publish on one line.
"""

from __future__ import annotations

import time

from console.numbers import count, decimal
from console.panels.features import feature_text
from console.panels.header import header_text
from console.panels.kv import kv_text
from console.panels.read import read_text
from console.panels.recent import recent_text
from console.panels.throughput import TokenRates, throughput_text
from nanoserve.stats import EngineStats

FEATURES = {"Capture": ("capture",), "Persistent inputs": ("inputs", "buckets"), "Linear kernels": ("linear",),
            "Tensor parallel": ("parallel",)}


def rows_text(stats: EngineStats) -> str:
    if not stats.rows:
        return "no request is running or waiting"
    header = f"{'id':<40} {'state':<8} {'prompt':>7} {'generated':>9} {'tok/s':>7} {'blocks':>6}"
    lines = [header] + [f"{r.request_id[:40]:<40} {r.state:<8} {count(r.prompt_tokens):>7} "
                        f"{count(r.generated_tokens):>9} {decimal(r.tokens_per_s):>7} {count(r.blocks):>6}"
                        for r in stats.rows]
    return "\n".join(lines)


def dashboard_text(stats: EngineStats, rates: TokenRates, status: str) -> str:
    blocks = [header_text(stats), status, ("Requests", rows_text(stats)), ("KV cache", kv_text(stats)),
              ("Throughput and latency", throughput_text(stats, *rates.rates())), ("Paged read", read_text(stats)),
              ("Recent (sliding windows)", recent_text(stats) or "no activity yet")]
    off = []
    for title, sections in FEATURES.items():
        text = feature_text(stats, sections)
        if text:
            blocks.append((title, text))
        else:
            off.append(title.lower())
    if off:
        blocks.append(f"off: {', '.join(off)} (not published by this engine)")
    out = []
    for block in blocks:
        if isinstance(block, tuple):
            title, text = block
            out += ["", f"== {title} ==", text]
        else:
            out.append(block)
    return "\n".join(out) + "\n"


def once_attached(urls: list[str], refresh_s: float, api_key: str | None = None) -> tuple[list[str], bool]:
    """Each server's dashboard text from two polls of its /health `refresh_s` apart (the rates are the
    differences of its counters between them, at the times they came back), and whether every one answered."""
    import httpx

    from console.remote import AttachedServer

    servers = [AttachedServer(url, refresh_s, api_key) for url in urls]
    texts, ok = [], True
    with httpx.Client(timeout=5.0, headers=servers[0].headers if servers else {}) as client:
        rates = [TokenRates() for _ in servers]
        for poll in range(2):
            for server, rate in zip(servers, rates):
                server.host.poll(client)
                if server.host.health.brought_snapshot:
                    rate.add(server.host.fetched_at, server.host.stats())
            if poll == 0:
                time.sleep(refresh_s)
    for server, rate in zip(servers, rates):
        health, stats = server.host.health, server.host.stats()
        if stats is None:
            ok = False
            texts.append(f"== {server.url} ==\nno snapshot: {health.status} ({health.reason})\n")
            continue
        ok = ok and health.serving
        state = "serving" if health.serving else f"{health.status} ({health.reason})"
        texts.append(dashboard_text(stats, rate, f"attached to {server.url}: {state} {server.model_name}"))
    return texts, ok


def once(server, refresh_s: float) -> str:
    """Two snapshots `refresh_s` apart from a serving server, as the dashboard's text."""
    rates = TokenRates()
    rates.add(time.monotonic(), server.host.stats())
    time.sleep(refresh_s)
    stats = server.host.stats()
    rates.add(time.monotonic(), stats)
    return dashboard_text(stats, rates, f"serving {server.model_name} at {server.url}/v1")
