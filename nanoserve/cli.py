"""The `nanoserve` command: serve MODEL, generate (one-shot or --chat), bench, --version."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import time

from nanoserve.api_key import add_api_key_flags, resolve_api_key
from nanoserve.errors import ConfigError, NanoserveError
from nanoserve.flags import (
    add_data_parallel_flags,
    add_engine_flags,
    add_sampling_flags,
    engine_flags,
    sampling_params,
)
from nanoserve.tools.parsers import PARSERS

# Sampling fields generate cannot show (it streams one completion's text), each with where to get them.
_GENERATE_SHOWS_NOT = {
    "n": "generate streams one completion; for n > 1 use LLM.generate or `nanoserve serve`",
    "prompt_logprobs": "generate prints the output only; for prompt logprobs use LLM.generate or "
                       "`nanoserve serve`",
}


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nanoserve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def cmd_generate(args) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    params = sampling_params(args)  # refused before the model loads
    defaults = {f.name: f.default for f in dataclasses.fields(params)}
    for name, why in _GENERATE_SHOWS_NOT.items():
        if getattr(params, name) != defaults[name]:
            raise ConfigError(f"--{name.replace('_', '-')}: {why}")
    if args.chat and not params.detokenize:
        raise ConfigError("--chat keeps the conversation as text, so it needs detokenize; "
                          "drop --no-detokenize")
    engine = Engine(EngineConfig.from_flags(**engine_flags(args)))
    if args.chat:
        return _chat_loop(engine, params, args.system)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    _stream(engine, engine.add_request(prompt, params), params)
    return 0


def _stream(engine, request_id: str, params) -> str:
    """Print a request's text (or its token ids, without detokenize) as it arrives; returns the whole text."""
    text, tokens, started, final = [], 0, time.monotonic(), None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            final = out
            tokens += len(out.delta_token_ids)
            delta = out.delta_text if params.detokenize else "".join(f"{i} " for i in out.delta_token_ids)
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
                text.append(out.delta_text)
    elapsed = time.monotonic() - started
    sys.stdout.write("\n")
    if final is not None and final.outputs[0].logprobs:
        _print_logprobs(final.outputs[0].logprobs)
    print(f"[{tokens} tokens, {tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return "".join(text)


def _print_logprobs(logprobs) -> None:
    """One line per generated token on stderr: the token and its logprob, then the other top alternatives.

    Each position is vLLM's {token id: Logprob}, the sampled token first.
    """
    def show(lp) -> str:
        return f"{lp.decoded_token!r} {lp.logprob:.4f}"

    for position in logprobs:
        sampled, *others = position.values()
        print(show(sampled) + "  | " + "  ".join(show(lp) for lp in others), file=sys.stderr)


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
            reply = _stream(engine, engine.add_request(ids, params), params)
        except NanoserveError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def serve_model(args) -> str | None:
    """The model `serve` runs: the positional MODEL (as `vllm serve` takes it) or --model, never two."""
    if args.model_tag is None:
        return args.model
    if args.model is not None and args.model != args.model_tag:
        raise ConfigError(f"two models given: {args.model_tag!r} (positional) and --model {args.model!r}; "
                          "pass one of them")
    return args.model_tag


def cmd_serve(args) -> int:
    from nanoserve.config import EngineConfig

    flags = {**engine_flags(args), "model": serve_model(args)}
    from nanoserve.server.serve import DataParallel, Server

    api_key, source = resolve_api_key(args.api_key, args.api_key_file)
    if source is not None:
        print(f"nanoserve: requiring the API key from {source}", flush=True)  # where from, never the key
    data_parallel = DataParallel(args.data_parallel_size, args.data_parallel_backend, args.ray_address,
                                 args.data_parallel_routing)
    server = Server(EngineConfig.from_flags(**flags), host=args.host, port=args.port,
                    api_key=api_key, served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                    trust_request_chat_template=args.trust_request_chat_template,
                    shutdown_timeout=args.shutdown_timeout, limit_concurrency=args.limit_concurrency,
                    header_timeout=args.header_timeout, body_timeout=args.body_timeout, tool_call_parser=args.tool_call_parser,
                    prompt_tokens_details=args.enable_prompt_tokens_details, data_parallel=data_parallel,
                    force_include_usage=args.enable_force_include_usage,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    per_request_metrics=args.enable_per_request_metrics)
    server.run()
    return 0


# each is nanoserve/bench/<name>.py with add_parser(sub) and main(args), run as `nanoserve bench <name>`
BENCHMARKS = ("throughput", "serve", "linear", "ab", "inputs", "graphs", "wire", "reads", "soak", "prefix", "prefill",
              "grammar", "budget", "spec", "hostile", "sizes")


def cmd_bench(args) -> int:
    return args.bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A small LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"nanoserve {version()}")
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
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory, .gguf file or Hugging Face id in the local cache "
                            "(same as --model; unset: the embedded default model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    add_api_key_flags(serve, "require 'Authorization: Bearer KEY' on every route but /health's status word, "
                             "/metrics, /version and the API docs (nanoserve/server/access.py)")
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: the file's)")
    serve.add_argument("--max-waiting", type=int, default=256, help="queue bound; beyond it requests get 503")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                       help="on SIGINT/SIGTERM, seconds running requests get to finish before they are aborted "
                            "(every stream still ends with [DONE]); default 10")
    serve.add_argument("--limit-concurrency", type=int, default=1000, metavar="N",
                       help="open connections beyond which the server answers 503 (default 1000)")
    serve.add_argument("--header-timeout", type=float, default=15.0, metavar="S",
                       help="seconds a client has to send a request's headers before its connection is closed "
                            "(default 15)")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                       help="seconds a client has to send a request's whole body once its headers are in; past "
                            "them it is answered 408 and its connection closed (default 30)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (it is rendered on the server, so "
                            "by default such requests are refused)")
    serve.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                       help="usage.prompt_tokens_details.cached_tokens in every completion and chat completion "
                            "(0 while the prefix cache is off), as vLLM's flag does; off by default, as there")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every streamed completion and chat completion carries its usage so far on every "
                            "chunk and ends with a usage chunk, as if it sent stream_options include_usage and "
                            "continuous_usage_stats (vLLM's flag)")
    serve.add_argument("--enable-per-request-metrics", action="store_true",
                       help="a one-sequence completion or chat completion carries vLLM's timing object `metrics` "
                            "(time to first token, generation, queue, mean inter-token latency, tokens per "
                            "second), whole or on a stream's final usage chunk (vLLM's flag)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens as 'token_id:N' on every request, as if each sent "
                            "return_tokens_as_token_ids (vLLM's flag)")
    serve.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                       help="the format tool_choice 'auto' reads calls in (default: the chat template's own, "
                            "Hermes <tool_call> blocks where it writes them or renders no tools)")
    add_data_parallel_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", add_help=False,
                            help="one tensor-parallel rank for a server on another machine (--distributed-init)")
    worker.add_argument("worker_args", nargs=argparse.REMAINDER, help="see `nanoserve worker --help`")

    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"nanoserve.bench.{name}")
        module.add_parser(bench_sub)
        bench_sub.choices[name].set_defaults(bench_main=module.main)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # its own parser: every flag after `worker` is the worker's
        from nanoserve.parallel.worker import main as worker_main

        return worker_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
