"""The `nanoserve-console` command: start an engine and watch it, or `--attach` to servers that run elsewhere;
`--once` prints one text snapshot instead of opening the app."""

from __future__ import annotations

import argparse
import sys

from nanoserve.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    from nanoserve.api_key import add_api_key_flags
    from nanoserve.flags import add_engine_flags

    parser = argparse.ArgumentParser(prog="nanoserve-console",
                                     description="nanoserve-console: the operator's terminal app, an engine and "
                                                 "its OpenAI server with screens to watch and steer.")
    add_engine_flags(parser)
    parser.add_argument("--port", type=int, default=0, help="OpenAI server port on 127.0.0.1 (0: a free port)")
    parser.add_argument("--refresh", type=float, default=1.0,
                        help="refresh interval, seconds (+/- on the dashboard change it while running)")
    parser.add_argument("--once", action="store_true",
                        help="print the dashboard once as text (two snapshots --refresh apart) and exit")
    parser.add_argument("--attach", action="append", default=[], metavar="URL",
                        help="watch a nanoserve server that runs elsewhere (its /health) instead of starting "
                             "one; repeat for several (replicas), shown as tabs ([ and ] switch)")
    add_api_key_flags(parser, "with --attach: the servers' API key, sent for their stats and by the chat, load "
                              "and flags screens")
    parser.add_argument("--keymap", action="append", default=[], metavar="ID=KEYS",
                        help="rebind a key by its binding id, e.g. --keymap quit=ctrl+q (repeatable; ids in ?)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from console.app import NanoserveConsole
    from console.remote import AttachedServer
    from nanoserve.api_key import resolve_api_key
    from nanoserve.errors import ConfigError
    from nanoserve.flags import engine_flags

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        keymap = dict(item.split("=", 1) for item in args.keymap)
    except ValueError:
        parser.error(f"--keymap takes ID=KEYS, got {args.keymap}")
    flags = engine_flags(args)
    if args.attach:
        given = [name for name, value in flags.items() if value != parser.get_default(name)]
        if given or args.port:
            named = ", ".join("--" + n.replace("_", "-") for n in given + (["port"] if args.port else []))
            parser.error(f"--attach watches servers that run elsewhere, with their own flags; {named} would "
                         "configure an engine here. Set them where the server runs, or drop --attach.")
    elif args.api_key or args.api_key_file:
        parser.error("--api-key is for --attach (the console's own server runs on loopback without a key)")
    try:  # attached: the key as the server reads it (--api-key, --api-key-file, then the environment)
        api_key = resolve_api_key(args.api_key, args.api_key_file)[0] if args.attach else None
    except ConfigError as e:
        parser.error(str(e))
    if args.once:
        return print_attached(args.attach, args.refresh, api_key) if args.attach else \
            print_once(EngineConfig.from_flags(**flags), args.port, args.refresh)
    if args.attach:
        app = NanoserveConsole(EngineConfig.from_flags(**flags), refresh_s=args.refresh,
                               servers=[AttachedServer(url, args.refresh, api_key) for url in args.attach])
    else:
        app = NanoserveConsole(EngineConfig.from_flags(**flags), port=args.port, refresh_s=args.refresh)
    app.set_keymap(keymap)
    app.run()
    if app.load_error is not None:  # the screen is gone: the reason stays in the terminal, and scripts see it
        print(f"nanoserve-console: the engine did not load: {app.load_error}", file=sys.stderr)
        return 1
    return 0


def print_once(config: EngineConfig, port: int, refresh_s: float) -> int:
    """--once: load, print the dashboard's text, stop. A model that does not load is exit 1, with why."""
    from console.snapshot import once
    from nanoserve.server.serve import Server

    try:
        server = Server(config, port=port).start()
    except Exception as e:
        print(f"nanoserve-console: the engine did not load: {e}", file=sys.stderr)
        return 1
    try:
        sys.stdout.write(once(server, refresh_s))
    finally:
        server.stop()
    return 0


def print_attached(urls: list[str], refresh_s: float, api_key: str | None) -> int:
    """--once --attach: each server's dashboard text, one after another; exit 1 when any did not answer (its
    block says why), so a script sees a replica that is down."""
    from console.snapshot import once_attached

    texts, ok = once_attached(urls, refresh_s, api_key)
    sys.stdout.write("\n".join(texts))
    return 0 if ok else 1
