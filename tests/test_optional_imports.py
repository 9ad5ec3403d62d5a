"""The quick-start install (no extras) runs every command: no module imports an optional package at its top,
a feature that needs one says in one line which extra brings it, and every optional import is registered in
nanoserve/optional.py. Each check runs in a fresh interpreter whose import hook hides every package outside
the runtime dependencies (tests/without_optional.py)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from nanoserve.optional import PACKAGES
from tests.without_optional import OWN, hidden_run

ROOT = Path(__file__).resolve().parent.parent

# Modules whose one job is an optional package: imported only where that package is known to be there.
FEATURE_MODULES = {"nanoserve.attention.streamed": "triton"}


def one_line_error(run) -> str:
    """The whole of stderr, which must be a single line (no traceback) and a failing status."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stdout, run.stderr)
    return lines[0]


def test_the_runtime_dependencies_bring_none_of_the_optional_packages(runtime_modules):
    assert {"torch", "fastapi", "textual", "gguf", "llguidance"} <= set(runtime_modules)
    assert not set(PACKAGES) & set(runtime_modules)


def test_every_module_imports_and_every_parser_builds_without_the_optional_packages(runtime_modules):
    run = hidden_run(runtime_modules, "walk")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["failed"].keys() == FEATURE_MODULES.keys(), report["failed"]
    for module, package in FEATURE_MODULES.items():
        assert f"No module named '{package}'" in report["failed"][module]
    assert "triton" in report["refused"]  # the hook did hide what the kernel module asked for


def _imported_tops(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, at any depth (inside functions too)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.partition(".")[0])
    return tops


def test_every_optional_import_is_registered_with_its_extra(runtime_modules):
    """An import outside stdlib and the runtime dependencies, anywhere in the product or its scripts, has an
    entry in nanoserve.optional.PACKAGES, so the error a user sees names the extra that brings it."""
    known = set(runtime_modules) | set(sys.stdlib_module_names) | OWN
    files = [*ROOT.glob("nanoserve/**/*.py"), *ROOT.glob("console/**/*.py"), *ROOT.glob("scripts/*.py")]
    unregistered = {f"{path.relative_to(ROOT)}: {top}" for path in files
                    for top in _imported_tops(path) - known - set(PACKAGES)}
    assert not unregistered
    extras = _project_extras()
    for module, package in PACKAGES.items():
        assert any(package.distribution in spec for spec in extras[package.extra]), (module, package.extra)


def _project_extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_bench_reads_without_triton_says_what_to_install_in_one_line(runtime_modules):
    line = one_line_error(hidden_run(runtime_modules, "cli", "bench", "reads"))
    assert "Triton, which is not installed" in line and "pip install 'nanoserve[gpu]'" in line, line


def test_otlp_traces_without_opentelemetry_say_what_to_install_in_one_line_before_any_load(runtime_modules):
    """fastapi may bring the OpenTelemetry API alone: the SDK and exporters are still the otel extra's."""
    line = one_line_error(hidden_run(runtime_modules, "cli", "serve", "--port", "0", "--otlp-traces-endpoint",
                                     "http://127.0.0.1:9/v1/traces"))
    assert "which is not installed" in line and "pip install 'nanoserve[otel]'" in line, line


def test_the_streamed_read_on_a_cpu_runs_its_torch_twin_without_triton(runtime_modules, tiny_checkpoint):
    argv = ["generate", "The capital of France is", "--model", str(tiny_checkpoint("llama")), "--max-tokens", "6",
            "--temperature", "0", "--max-model-len", "64", "--kv-cache-gib", "0.01"]
    streamed = hidden_run(runtime_modules, "cli", *argv, "--streamed-read", "--no-batch-invariant")
    assert streamed.returncode == 0, streamed.stderr
    assert "[6 tokens" in streamed.stderr
    gathered = hidden_run(runtime_modules, "cli", *argv)
    assert streamed.stdout == gathered.stdout  # the same text through the other read


def test_scripts_name_the_extra_they_need(runtime_modules, tmp_path):
    line = one_line_error(hidden_run(runtime_modules, "script", "scripts/random-checkpoint.py", "--out", str(tmp_path)))
    assert "needs transformers, which is not installed: pip install 'nanoserve[hf]'" in line, line
    line = one_line_error(hidden_run(runtime_modules, "script", "scripts/screenshots.py", "--out", str(tmp_path)))
    assert "needs cairosvg, which is not installed: pip install 'nanoserve[docs]'" in line, line
