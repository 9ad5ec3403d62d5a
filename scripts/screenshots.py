"""Render a PNG of every console screen from the app itself, on the embedded default model, with real activity.

    pip install -e '.[docs]' && python scripts/screenshots.py [--out docs/screens]

Drives the console with Textual's pilot (no terminal needed): load on the dashboard, a finished load run, a chat
answer, a flags change in progress, an A/B run, the engine log and the help; then `--attach` to two replicas and
an address that is down. Each screen is exported as SVG by
Textual and converted to PNG with cairosvg.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from console import keys  # noqa: E402
from console.app import SCREENS, NanoserveConsole  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.errors import NanoserveError  # noqa: E402
from nanoserve.optional import require  # noqa: E402
from tests.console_helpers import Requests, started, wait_until  # noqa: E402

SIZE = (160, 46)


async def go(pilot, mode: str) -> None:
    await pilot.press("escape", SCREENS[mode][1])
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, SCREENS[mode][0]), 5, mode)
    await pilot.pause(0.3)


def save(app, out: Path, name: str) -> None:
    import cairosvg

    svg = app.export_screenshot(title=f"nanoserve console: {name}")
    cairosvg.svg2png(bytestring=svg.encode(), write_to=str(out / f"{name}.png"))
    print(f"wrote {out / name}.png", flush=True)


async def dashboard(app, pilot, out):
    await go(pilot, "dashboard")
    load = Requests(app.server.url, n=6, max_tokens=96)
    await wait_until(pilot, lambda: app.server.host.stats().scheduler.generation_tokens_total > 150, 120, "load")
    await pilot.pause(1.0)
    save(app, out, "dashboard")
    await asyncio.to_thread(load.join, 300)


async def load_screen(app, pilot, out):
    await go(pilot, "load")
    screen = app.screen
    for field, value in {"#load-n": "12", "#load-concurrency": "6", "#load-output": "32"}.items():
        screen.query_one(field).value = value
    await pilot.press(keys.RUN)
    await wait_until(pilot, lambda: screen.summary is not None, 300, "the load run")
    save(app, out, "load")


async def chat(app, pilot, out):
    await go(pilot, "chat")
    screen = app.screen
    screen.query_one("#chat-input").value = "What is the capital of France? Answer in one sentence."
    screen.query_one("#chat-input").focus()
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(screen.history) == 2 and not screen.generating, 120, "the answer")
    save(app, out, "chat")


async def flags(app, pilot, out):
    await go(pilot, "flags")
    app.screen.query_one("#flag-max_num_seqs").value = "8"
    await pilot.press("ctrl+s")
    await pilot.pause(0.3)
    save(app, out, "flags-confirm")
    await pilot.press("y")
    await wait_until(pilot, lambda: app.restarts == 1, 120, "the restart")
    await pilot.pause(0.5)
    save(app, out, "flags")


async def ab(app, pilot, out):
    await go(pilot, "ab")
    screen = app.screen
    for field, value in {"#num-prompts": "6", "#max-tokens": "16"}.items():  # the interpreted B read is slow
        screen.query_one(field).value = value
    await pilot.press(keys.RUN)
    await wait_until(pilot, lambda: screen.running, 10, "the A/B run to start")
    await wait_until(pilot, lambda: not screen.running, 600, "the A/B run")
    await pilot.pause(0.5)
    save(app, out, "ab")


async def log_and_help(app, pilot, out):
    await go(pilot, "log")
    save(app, out, "log")
    await go(pilot, "dashboard")
    await pilot.press("question_mark")
    await pilot.pause(0.3)
    save(app, out, "help")
    await pilot.press("escape")


async def attached(out: Path) -> None:
    """`--attach` to two replicas (two servers on loopback, one under load) and a third address that is down."""
    from console.remote import AttachedServer
    from nanoserve.server.serve import Server

    replicas = [Server(EngineConfig(device="cpu", max_model_len=1024, kv_cache_gib=0.1), port=0).start()
                for _ in range(2)]
    try:
        app = NanoserveConsole(EngineConfig(), refresh_s=0.25,
                               servers=[*(AttachedServer(r.url, 0.25) for r in replicas),
                                        AttachedServer("127.0.0.1:9", 0.25)])
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.phase == "serving", 30, "the first replica")
            load = Requests(replicas[0].url, n=6, max_tokens=96)
            await wait_until(pilot, lambda: replicas[0].host.stats().scheduler.generation_tokens_total > 150, 120,
                             "load")
            await pilot.pause(1.0)
            save(app, out, "attach")
            await asyncio.to_thread(load.join, 300)
    finally:
        for replica in replicas:
            replica.stop()


async def main_async(out: Path, only: list[str]) -> None:
    app = NanoserveConsole(EngineConfig(device="cpu", max_model_len=1024, kv_cache_gib=0.1), refresh_s=0.25)
    steps = {"dashboard": dashboard, "load": load_screen, "chat": chat, "flags": flags, "ab": ab,
             "log": log_and_help}
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        for name, step in steps.items():
            if not only or name in only:
                await step(app, pilot, out)
    if not only or "attach" in only:
        await attached(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/screens")
    p.add_argument("only", nargs="*", help="screens to render (default: all)")
    args = p.parse_args()
    try:  # before minutes of rendering, not after
        require("cairosvg", "scripts/screenshots.py")
    except NanoserveError as e:
        print(f"screenshots: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(out, args.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
