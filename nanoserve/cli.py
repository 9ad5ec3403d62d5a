"""The `nanoserve` command: generate (one-shot or --chat), bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from nanoserve.errors import NanoserveError


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One argparse flag per EngineConfig field, so the CLI can never lag the config."""
    from nanoserve.config import EngineConfig

    for spec in EngineConfig.flag_specs():
        flag = "--" + spec.name.replace("_", "-")
        if spec.kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default,
                           help=f"{spec.help} (default: {spec.default})")
        else:
            p.add_argument(flag, type=spec.kind, default=spec.default, metavar=spec.name.upper(),
                           help=f"{spec.help} (default: {spec.default})")


def engine_flags(args: argparse.Namespace) -> dict:
    from nanoserve.config import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args):
    from nanoserve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
    )


def cmd_generate(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    engine = Engine(EngineConfig.from_flags(**engine_flags(args)))
    params = sampling_params(args)
    if args.chat:
        return _chat_loop(engine, params, args.system)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    _stream(engine, engine.add_request(prompt, params))
    return 0


def _stream(engine, request_id: str) -> str:
    """Print a request's text as it arrives; returns the whole text."""
    text, tokens, started = [], 0, time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            tokens += len(out.delta_token_ids)
            if out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                text.append(out.delta_text)
    elapsed = time.monotonic() - started
    sys.stdout.write("\n")
    print(f"[{tokens} tokens, {tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return "".join(text)


def _chat_loop(engine, params, system: str | None) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    print("nanoserve chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        try:
            reply = _stream(engine, engine.add_request(ids, params))
        except NanoserveError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.server.serve import Server

    server = Server(EngineConfig.from_flags(**engine_flags(args)), host=args.host, port=args.port,
                    api_key=args.api_key, served_model_name=args.served_model_name, max_waiting=args.max_waiting)
    server.run()
    return 0


def cmd_bench(args) -> int:
    return args.bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A small LLM inference engine.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, or chat interactively")
    gen.add_argument("prompt", nargs="?", help="prompt text (read from stdin when omitted)")
    gen.add_argument("--chat", action="store_true", help="interactive multi-turn chat with the chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    add_sampling_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: the file's)")
    serve.add_argument("--max-waiting", type=int, default=256, help="queue bound; beyond it requests get 503")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from nanoserve.bench import ab, graphs, inputs, linear, reads, throughput, wire
    from nanoserve.bench import serve as serve_bench

    for module in (throughput, serve_bench, linear, ab, inputs, graphs, wire, reads):
        module.add_parser(bench_sub, add_engine_flags)
        bench_sub.choices[module.__name__.rsplit(".", 1)[1]].set_defaults(bench_main=module.main)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
