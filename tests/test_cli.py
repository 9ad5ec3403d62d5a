"""The `nanoserve` command: generate streams to stdout, --chat runs a multi-turn loop, errors exit cleanly."""

from __future__ import annotations

import io
import sys

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.cli import main


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
