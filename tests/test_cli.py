"""The `nanoserve` command: generate streams to stdout, --chat runs a multi-turn loop, errors exit cleanly."""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.cli import build_parser, main, serve_model
from nanoserve.flags import SAMPLING_FLAG_NAMES, sampling_params
from nanoserve.sampling_params import SamplingParamsError


def test_generate_streams_the_same_text_as_the_api(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("llama"))
    flags = ["--model", path, "--max-model-len", "128", "--kv-cache-gib", "0.01"]
    assert main(["generate", "Once upon a time", "--max-tokens", "12", *flags]) == 0
    printed = capsys.readouterr().out
    expected = LLM(model=path, max_model_len=128, kv_cache_gib=0.01).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=12)
    )[0].outputs[0].text
    assert printed == expected + "\n"


def test_chat_loop_answers_each_message_and_takes_reset_as_a_command(tiny_checkpoint, capsys, monkeypatch):
    path = str(tiny_checkpoint("llama"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n/reset\nfresh start\n"))
    code = main(["generate", "--chat", "--max-tokens", "5", "--model", path, "--max-model-len", "256",
                 "--kv-cache-gib", "0.01"])
    assert code == 0
    err = capsys.readouterr().err
    assert err.count("tokens,") == 3  # one reply per message, /reset is a command, not a message


def test_bad_flag_value_is_a_clean_error(tiny_checkpoint, capsys):
    code = main(["generate", "x", "--model", str(tiny_checkpoint("llama")), "--block-size", "12"])
    assert code == 2
    assert "power of two" in capsys.readouterr().err


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_subcommand_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["fly"])


def test_version_is_the_installed_distributions(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoserve {metadata.version('nanoserve')}"


def generate_parser():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def test_every_sampling_field_has_a_flag_with_help():
    by_dest = {a.dest: a for a in generate_parser()._actions}
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    lacking = [name for name in fields if not getattr(by_dest.get(f"sampling_{name}"), "help", "")]
    assert not lacking, (f"SamplingParams fields without a `nanoserve generate` flag or its help: {lacking}; "
                         "add their help to SAMPLING_HELP in nanoserve/flags.py")
    shown = generate_parser().format_help()
    for name in fields:
        assert SAMPLING_FLAG_NAMES.get(name, "--" + name.replace("_", "-")) in shown


def test_sampling_flags_reach_sampling_params():
    args = build_parser().parse_args([
        "generate", "x", "--top-k", "5", "--sample-seed", "3", "--stop", "a", "--stop", "b b",
        "--stop-token-ids", "2,5", "--stop-token-ids", "7", "--no-skip-special-tokens", "--ignore-eos",
        "--logit-bias", "5=-100", "--logit-bias", "6=2.5", "--allowed-token-ids", "1,2,3",
        "--bad-words", "darn", "--min-tokens", "2", "--logprobs", "1", "--seed", "9",
    ])
    assert sampling_params(args) == SamplingParams(
        temperature=0.0, max_tokens=256,  # the command line's own defaults: greedy, room for an answer
        top_k=5, seed=3, stop=["a", "b b"], stop_token_ids=[2, 5, 7], skip_special_tokens=False,
        ignore_eos=True, logit_bias={5: -100.0, 6: 2.5}, allowed_token_ids=[1, 2, 3], bad_words=["darn"],
        min_tokens=2, logprobs=1,
    )
    assert args.seed == 9  # --seed stays the engine's flag
    assert sampling_params(build_parser().parse_args(["generate", "x"])) == SamplingParams(temperature=0,
                                                                                           max_tokens=256)


@pytest.mark.parametrize("flag, value, expected", [
    ("--logit-bias", "5", "ID=BIAS"), ("--logit-bias", "x=1", "ID=BIAS"),
    ("--stop-token-ids", "2,z", "token ids"),
])
def test_malformed_list_flags_are_usage_errors(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "x", flag, value])
    assert e.value.code == 2 and expected in capsys.readouterr().err


def test_a_bad_sampling_value_is_refused_before_the_model_loads(tmp_path, capsys):
    code = main(["generate", "x", "--top-p", "0", "--model", str(tmp_path / "not-loaded")])
    assert code == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "does not exist" not in err


def test_generate_prints_logprobs_it_was_asked_for(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("llama"))
    assert main(["generate", "Once upon a time", "--max-tokens", "4", "--logprobs", "2", "--model", path,
                 "--max-model-len", "128", "--kv-cache-gib", "0.01"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "  | " in line]
    expected = LLM(model=path, max_model_len=128, kv_cache_gib=0.01).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0].outputs[0].logprobs
    assert len(lines) == len(expected) == 4
    for line, position in zip(lines, expected):
        sampled, *others = position.values()
        head, tail = line.split("  | ")
        assert head == f"{sampled.decoded_token!r} {sampled.logprob:.4f}"
        assert tail == "  ".join(f"{lp.decoded_token!r} {lp.logprob:.4f}" for lp in others) and others


def test_generate_without_detokenize_prints_the_ids_the_flags_chose(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("llama"))
    flags = ["--model", path, "--max-model-len", "128", "--kv-cache-gib", "0.01"]
    assert main(["generate", "Once upon a time", "--max-tokens", "3", "--no-detokenize", *flags]) == 0
    expected = LLM(model=path, max_model_len=128, kv_cache_gib=0.01).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert capsys.readouterr().out.split() == [str(i) for i in expected]
    # A bias of 100 on one id wins every pick: the ID=BIAS flag reaches the sampler as {id: bias}.
    assert main(["generate", "Once upon a time", "--max-tokens", "3", "--no-detokenize", "--ignore-eos",
                 "--logit-bias", "4242=100", *flags]) == 0
    assert capsys.readouterr().out.split() == ["4242"] * 3


def test_generate_refuses_what_it_cannot_show(tmp_path, capsys):
    assert main(["generate", "x", "--n", "2", "--model", str(tmp_path / "not-loaded")]) == 2
    assert "LLM.generate" in capsys.readouterr().err
    assert main(["generate", "--chat", "--no-detokenize", "--model", str(tmp_path / "not-loaded")]) == 2
    assert "needs detokenize" in capsys.readouterr().err


def test_serve_takes_the_model_as_its_first_argument():
    parse = build_parser().parse_args
    assert serve_model(parse(["serve", "Org/Model", "--port", "9"])) == "Org/Model"
    assert serve_model(parse(["serve", "--model", "/ckpt"])) == "/ckpt"
    assert serve_model(parse(["serve", "/ckpt", "--model", "/ckpt"])) == "/ckpt"
    assert serve_model(parse(["serve"])) is None  # the embedded default model


def test_serve_with_two_different_models_names_both(capsys):
    assert main(["serve", "/one", "--model", "/two"]) == 2
    err = capsys.readouterr().err
    assert "'/one'" in err and "'/two'" in err and "pass one of them" in err


def test_flag_helpers_live_outside_the_cli_so_nothing_imports_it_back():
    """bench and console take their flags from nanoserve.flags; importing nanoserve.cli would be a cycle."""
    import ast

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*root.glob("nanoserve/**/*.py"), *root.glob("console/**/*.py")]:
        if path.name == "cli.py" and path.parent.name == "nanoserve":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "nanoserve.cli" or (
                    isinstance(node, ast.Import) and any(a.name == "nanoserve.cli" for a in node.names)):
                offenders.append(str(path.relative_to(root)))
    assert not offenders, f"these modules import nanoserve.cli: {offenders}; import nanoserve.flags instead"


@pytest.mark.parametrize("value", ["-1", "0"])
def test_max_tokens_below_1_is_refused_in_the_command_lines_words(value, tmp_path, capsys):
    """SamplingParams says "use None" (right in Python); a flag cannot be None, so the CLI says leave it out."""
    assert main(["generate", "x", "--max-tokens", value, "--model", str(tmp_path / "not-loaded")]) == 2
    err = capsys.readouterr().err
    assert f"--max-tokens must be at least 1, got {value}; leave it out for 256 tokens" in err
    assert "None" not in err
    with pytest.raises(SamplingParamsError, match="use None to generate up to the model's context length"):
        SamplingParams(max_tokens=int(value))
