"""Run nanoserve as the quick-start install has it: every package outside the runtime dependencies hidden.

The parent (a test) works out which top-level modules the runtime dependencies bring (`runtime_modules`) and
runs this file in a fresh interpreter with them in NANOSERVE_ALLOWED_MODULES. Here an import hook then refuses
every other non-stdlib module, as if it were not installed, before anything of nanoserve is imported:

    python tests/without_optional.py walk                   # import every module, build every parser: JSON
    python tests/without_optional.py cli ARGS...            # nanoserve.cli.main(ARGS)
    python tests/without_optional.py script PATH ARGS...    # a script run as __main__
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import sysconfig

OWN = {"nanoserve", "console", "tests"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where the standard library lives, for its modules that sys.stdlib_module_names leaves out (_sysconfigdata_*)
STDLIB_DIRS = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
                     | {os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload")})


class HidingPathFinder(importlib.abc.MetaPathFinder):
    """Python's path finder, blind to top-level modules outside `allowed` and the standard library: for those
    `import` raises ModuleNotFoundError and `importlib.util.find_spec` answers None, exactly as when the package
    is not installed (torch, for one, probes optional packages with find_spec)."""

    def __init__(self, allowed: set[str], hidden_parts: tuple[str, ...] = ()):
        self.allowed = allowed
        self.hidden_parts = hidden_parts  # dotted packages inside a visible namespace (opentelemetry.sdk)
        self.refused: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        hidden_part = any(name == part or name.startswith(part + ".") for part in self.hidden_parts)
        if (path is None and not self._visible(name)) or hidden_part:
            self.refused.add(name)
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()

    def _visible(self, top: str) -> bool:
        return (top in self.allowed or top in sys.stdlib_module_names
                or importlib.machinery.PathFinder.find_spec(top, STDLIB_DIRS) is not None)

    def install(self) -> HidingPathFinder:
        """Stand in for the path finder (the finders before it, editable installs' among them, stay)."""
        sys.meta_path[:] = [self if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
        return self


def runtime_modules() -> set[str]:
    """Top-level module names of nanoserve's runtime dependencies and theirs (no extras): what
    `pip install -e .` installs. Run in the parent, where `packaging` is at hand."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo: list[tuple[str, frozenset]] = [("nanoserve", frozenset())]
    while todo:
        dist, extras = todo.pop()
        try:
            requires = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue  # required only on another platform, say
        for spec in requires:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
                continue
            name = canonicalize_name(req.name)
            if name not in seen:
                seen.add(name)
                todo.append((name, frozenset(req.extras)))
    return {top for top, dists in md.packages_distributions().items()
            if any(canonicalize_name(d) in seen for d in dists)}


def hidden_run(allowed: list[str], *argv: str, timeout: float = 300):
    """This file run with `argv` in a fresh interpreter that sees only `allowed` (see runtime_modules)."""
    import subprocess

    from nanoserve.optional import PACKAGES

    env = {**os.environ, "NANOSERVE_ALLOWED_MODULES": json.dumps(allowed),
           "NANOSERVE_HIDDEN_PARTS": json.dumps([name for name in PACKAGES if "." in name])}
    return subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _walk() -> dict:
    import importlib
    import pkgutil

    failed = {}
    for root in ("nanoserve", "console"):
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            try:
                importlib.import_module(info.name)
            except Exception as e:  # noqa: BLE001 (every failure is the report)
                failed[info.name] = f"{type(e).__name__}: {e}"
    from console.cli import build_parser as console_parser
    from nanoserve.cli import build_parser

    build_parser().format_help()
    console_parser().format_help()
    return failed


def main(argv: list[str]) -> int:
    allowed = set(json.loads(os.environ["NANOSERVE_ALLOWED_MODULES"])) | OWN
    hook = HidingPathFinder(allowed, tuple(json.loads(os.environ.get("NANOSERVE_HIDDEN_PARTS", "[]")))).install()
    mode, args = argv[0], argv[1:]
    if mode == "walk":
        failed = _walk()
        print(json.dumps({"failed": failed, "refused": sorted(hook.refused)}))
        return 0
    if mode == "cli":
        from nanoserve.cli import main as cli

        return cli(args)
    if mode == "script":
        import runpy

        sys.argv = args
        try:
            runpy.run_path(args[0], run_name="__main__")
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
