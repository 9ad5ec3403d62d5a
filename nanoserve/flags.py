"""Command-line flags generated from EngineConfig and SamplingParams, for every front end that parses argv.

Generated from the dataclasses so a new field reaches the command line without anyone writing a flag, and kept
out of cli.py so the benchmarks and the console import them without importing the command that imports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from collections.abc import Sequence

from nanoserve.config import EngineConfig
from nanoserve.sampling_params import SamplingParams, SamplingParamsError
from nanoserve.structured.params import StructuredOutputsParams


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One argparse flag per EngineConfig field, so the CLI can never lag the config."""
    for spec in EngineConfig.flag_specs():
        flag = "--" + spec.name.replace("_", "-")
        if spec.kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default,
                           help=f"{spec.help} (default: {spec.default})")
        else:
            p.add_argument(flag, type=_finite if spec.kind is float else spec.kind, default=spec.default,
                           metavar=spec.name.upper(), help=f"{spec.help} (default: {spec.default})")


def _finite(text: str) -> float:
    """A float flag's value: inf and nan (which float() takes) are refused where they are typed."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def engine_flags(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments a parser built with `add_engine_flags` collected."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


# Help for every SamplingParams field; a field missing here still gets a flag, with empty help, and
# tests/test_cli.py names it, so a new field is one line here.
SAMPLING_HELP: dict[str, str] = {
    "n": "completions per prompt (generate streams one and refuses more: use LLM.generate or the server)",
    "temperature": "0 picks the most likely token (greedy); higher values flatten the distribution",
    "top_p": "sample from the smallest set of tokens whose probability reaches P (1: off)",
    "top_k": "sample from the K most likely tokens (0 or -1: off)",
    "min_p": "drop tokens less likely than P times the most likely one (0: off)",
    "repetition_penalty": "divide the logits of tokens already in prompt or output by this (1: off)",
    "presence_penalty": "subtract this from the logits of tokens already generated, once each (-2..2)",
    "frequency_penalty": "subtract this times the count of each token already generated (-2..2)",
    "seed": "this request's sampling seed: the same seed and prompt give the same text",
    "max_tokens": "most tokens to generate",
    "min_tokens": "tokens to generate before EOS, a stop token id or a stop string may end the output",
    "stop": "end the output where this string appears (repeatable)",
    "stop_token_ids": "stop at any of these token ids (repeatable, or a comma list: 2,49152)",
    "ignore_eos": "keep generating past the end-of-sequence token",
    "logprobs": "print each generated token's logprob and its N most likely alternatives to stderr",
    "skip_special_tokens": "leave special tokens out of the text",
    "include_stop_str_in_output": "keep the stop string that ended the output in the text",
    "prompt_logprobs": "logprobs of each prompt token after the first, top N (generate refuses it: use "
                       "LLM.generate or the server)",
    "detokenize": "turn tokens into text; --no-detokenize prints the token ids instead",
    "logit_bias": "add BIAS (-100..100) to token ID's logit before the pick (repeatable ID=BIAS)",
    "allowed_token_ids": "sample only among these token ids (repeatable, or a comma list)",
    "bad_words": "a word the output must never complete (repeatable)",
    "logprob_token_ids": "with --logprobs: the alternatives printed at each position are exactly these token ids "
                         "(and the sampled one), in place of the top N (repeatable, or a comma list)",
    "structured_outputs": "constrain the output, as JSON: {\"json\": SCHEMA}, {\"json_object\": true}, "
                          "{\"regex\": RE}, {\"choice\": [A, B]} or {\"grammar\": LARK_OR_GBNF}",
}
# The engine's --seed seeds unseeded requests' generator; the request's own seed needs another name.
SAMPLING_FLAG_NAMES = {"seed": "--sample-seed"}
# The command line is for reading answers: greedy, and long enough for one, unless asked otherwise.
SAMPLING_CLI_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
_DEST = "sampling_"


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids such as 2 or 2,49152, got {text!r}") from None


def _bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS such as 1234=-100, got {text!r}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as {{\"regex\": \"[0-9]+\"}}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _kind(name: str, hint) -> str:
    """bool, int, float, str, ints, strs, bias or json: how a SamplingParams field is typed on a command line."""
    members = [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
    for m in members:
        if m is StructuredOutputsParams:
            return "json"
        origin, args = typing.get_origin(m), typing.get_args(m)
        if origin is dict and args == (int, float):
            return "bias"
        if origin in (list, tuple, Sequence) and args[:1] in ((int,), (str,)):
            return "ints" if args[0] is int else "strs"
    if len(members) == 1 and members[0] in (bool, int, float, str):
        return members[0].__name__
    raise TypeError(f"SamplingParams.{name} is typed {hint}, which nanoserve/flags.py cannot put on a "
                    "command line; give it a kind in flags._kind")


def sampling_flags() -> list[tuple[dataclasses.Field, str, str]]:
    """(field, flag, kind) for every SamplingParams field, in declaration order."""
    hints = typing.get_type_hints(SamplingParams)
    return [(f, SAMPLING_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")),
             _kind(f.name, hints[f.name])) for f in dataclasses.fields(SamplingParams)]


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field; only flags given (or with a CLI default) reach SamplingParams."""
    group = p.add_argument_group("sampling", "how each token is picked (SamplingParams)")
    for f, flag, kind in sampling_flags():
        default = SAMPLING_CLI_DEFAULTS.get(f.name, f.default)
        shown = "unset" if default in (None, dataclasses.MISSING) else default
        text = SAMPLING_HELP.get(f.name, "").replace("%", "%%")
        common = dict(dest=_DEST + f.name, help=f"{text} (default: {shown})" if text else "",
                      default=SAMPLING_CLI_DEFAULTS.get(f.name, argparse.SUPPRESS))
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif kind in ("int", "float", "str"):
            scalar = {"int": int, "float": float, "str": str}[kind]
            group.add_argument(flag, type=scalar, metavar=kind.upper(), **common)
        elif kind == "ints":
            group.add_argument(flag, type=_int_list, action="extend", metavar="ID[,ID...]", **common)
        elif kind == "strs":
            group.add_argument(flag, action="append", metavar="TEXT", **common)
        elif kind == "json":
            group.add_argument(flag, type=_json_object, metavar="JSON", **common)
        else:
            group.add_argument(flag, type=_bias, action="append", metavar="ID=BIAS", **common)


def sampling_values(args: argparse.Namespace) -> dict:
    """The SamplingParams keyword arguments given on the command line (plus the CLI's own defaults)."""
    values = {name.removeprefix(_DEST): value for name, value in vars(args).items() if name.startswith(_DEST)}
    if "logit_bias" in values:
        values["logit_bias"] = dict(values["logit_bias"])
    return values


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags `add_sampling_flags` added; its own checks refuse bad values, and a refusal
    whose fix is a Python value (None) is said in the command line's words."""
    values = sampling_values(args)
    try:
        return SamplingParams(**values)
    except SamplingParamsError as e:
        if e.field == "max_tokens":  # SamplingParams says "use None"; a flag cannot be None, only left out
            raise SamplingParamsError("max_tokens", (
                f"--max-tokens must be at least 1, got {values['max_tokens']}; leave it out for "
                f"{SAMPLING_CLI_DEFAULTS['max_tokens']} tokens, or give more, up to the model's context length "
                "(--max-model-len)")) from None
        raise


def add_data_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's data-parallel flags (nanoserve/dp/): replicas behind this server's one front end."""
    group = parser.add_argument_group("data parallelism")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="engine replicas, each its own process with its share of the CPU threads, or its own "
                            "GPU; requests are routed by prefix-cache affinity, then load (default 1)")
    group.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"), default="mp",
                       help="mp: processes on this machine; ray: actors on an existing Ray cluster (`ray start "
                            "--head`; needs the ray extra)")
    group.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                       help="the Ray cluster for --data-parallel-backend ray (default: the one `ray start` "
                            "left running here, RAY_ADDRESS)")
    group.add_argument("--data-parallel-routing", choices=("prefix-affinity", "least-loaded", "round-robin"),
                       default="prefix-affinity",
                       help="how the front end picks a replica: the longest cached prefix among replicas not a "
                            "batch behind the least loaded, then load (default); load only; or in turn")
