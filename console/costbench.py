"""What watching costs: engine throughput under the same load, headless and with the console attached.

    python -m console.costbench [--repeats 3] [--num-prompts 16] [--concurrency 8] [--output-len 48]

Both arms run in this process on one loaded model: arm "headless" fires the load at the server alone; arm
"console" fires the same load while the console hosts that server, renders the dashboard at its refresh
interval (Textual's headless driver: every frame is composed, none is written to a terminal) and, every
`--key-every` seconds, answers a key press whose round trip is timed. Arms alternate (headless, console, headless, ...) so
drift on a noisy machine lands on both. Prints a table and writes bench-results/console-cost.{json,csv}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from console.app import NanoserveConsole
from nanoserve import client, workload
from nanoserve.bench.common import print_table, write_results
from nanoserve.config import EngineConfig
from nanoserve.server.serve import Server


async def fire(server: Server, args) -> float:
    """Output tokens/s of one load run against `server`."""
    bodies = workload.make_bodies(args.num_prompts, "builtin", 0, args.output_len, 0,
                                     server.engine.model_config.vocab_size)
    results, duration, _ = await client.fire(server.url, bodies, args.concurrency, None, {}, 0)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return client.summarise(results, duration)["output_tok_per_s"]


async def headless_arm(server: Server, args) -> dict:
    return {"arm": "headless", "output_tok_per_s": await fire(server, args), "key_ms_p50": None, "key_ms_max": None}


async def console_arm(server: Server, args) -> dict:
    """The console app around the same server: its dashboard refreshing while the load runs."""
    app = NanoserveConsole(server.host.engine.config, refresh_s=args.refresh, servers=[server])
    async with app.run_test(size=(160, 50)):
        load = asyncio.create_task(fire(server, args))
        key_ms = []
        while not load.done():
            await asyncio.sleep(args.key_every)
            key_ms.append(await key_round_trip(app))
        rate = await load
    return {"arm": "console", "output_tok_per_s": rate, "key_ms_p50": statistics.median(key_ms),
            "key_ms_max": max(key_ms)}


async def key_round_trip(app) -> float:
    """Milliseconds from a key press reaching the app to the dashboard having acted on it.

    The key goes in as a terminal driver delivers it (a Key event posted to the app); `p` toggles pause, which
    the dashboard answers at once by redrawing its status line. Polled every millisecond on the same loop.
    """
    from textual import events

    dashboard = app.screen
    before = dashboard.paused
    started = time.perf_counter()
    app.post_message(events.Key("p", "p"))
    while dashboard.paused == before:
        await asyncio.sleep(0.001)
    return (time.perf_counter() - started) * 1000


async def main_async(args) -> list[dict]:
    server = Server(EngineConfig.from_flags(model=args.model, device="cpu" if args.cpu else "auto"), port=0).start()
    try:
        await fire(server, argparse.Namespace(**{**vars(args), "num_prompts": 2, "output_len": 4}))  # warm-up
        rows = []
        for repeat in range(args.repeats):
            for arm in (headless_arm, console_arm):
                row = {"repeat": repeat, **await arm(server, args)}
                print(row, flush=True)
                rows.append(row)
        return rows
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m console.costbench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--refresh", type=float, default=1.0, help="the console's refresh interval in the console arm")
    p.add_argument("--key-every", type=float, default=2.0, help="seconds between timed key presses")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args(argv)
    rows = asyncio.run(main_async(args))
    print_table("per run (arms interleaved)", rows, ["repeat", "arm", "output_tok_per_s", "key_ms_p50", "key_ms_max"])
    med = {arm: statistics.median(r["output_tok_per_s"] for r in rows if r["arm"] == arm)
           for arm in ("headless", "console")}
    keys = [r["key_ms_max"] for r in rows if r["arm"] == "console"]
    summary = {"headless_tok_per_s": med["headless"], "console_tok_per_s": med["console"],
               "console_over_headless": med["console"] / med["headless"], "worst_key_ms": max(keys)}
    print_table("medians", [summary], list(summary))
    print(f"wrote {write_results(args.out, 'console-cost', {'summary': summary}, rows, args)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
