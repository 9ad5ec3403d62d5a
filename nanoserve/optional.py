"""Packages outside the runtime dependencies: imported only by the feature that needs them.

A missing one is a one-line error naming the extra that brings it, raised when that feature is used, never at
the import of an unrelated command. Every optional package nanoserve or its scripts import is listed here, and
`tests/test_optional_imports.py` walks every module with all of them hidden.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from nanoserve.errors import ConfigError


@dataclass(frozen=True)
class OptionalPackage:
    distribution: str  # what pip installs
    extra: str  # the nanoserve extra that brings it
    used_for: str


PACKAGES: dict[str, OptionalPackage] = {  # import name -> the package
    "triton": OptionalPackage("triton", "gpu", "the streamed read's compiled kernel on CUDA"),
    "transformers": OptionalPackage("transformers", "hf", "transformers' benchmark arm and random checkpoints"),
    "llama_cpp": OptionalPackage("llama-cpp-python", "peers", "llama.cpp's benchmark arm"),
    "xgrammar": OptionalPackage("xgrammar", "peers", "xgrammar's arm in bench grammar"),
    "zmq": OptionalPackage("pyzmq", "kv-events", "--kv-events-config: KV events over ZMQ"),
    "msgpack": OptionalPackage("msgpack", "kv-events", "--kv-events-config: KV events in msgpack"),
    "ray": OptionalPackage("ray", "ray", "--data-parallel-backend ray: replicas as Ray actors"),
    "cairosvg": OptionalPackage("cairosvg", "docs", "the console screenshots as PNG"),
    # a namespace package that fastapi may bring the API of: the parts are named by their dotted paths
    "opentelemetry.sdk": OptionalPackage("opentelemetry-sdk", "otel", "--otlp-traces-endpoint's spans"),
    "opentelemetry.exporter.otlp.proto.http": OptionalPackage("opentelemetry-exporter-otlp-proto-http", "otel",
                                                              "--otlp-traces-endpoint over OTLP/HTTP"),
    "opentelemetry.exporter.otlp.proto.grpc": OptionalPackage("opentelemetry-exporter-otlp-proto-grpc", "otel",
                                                              "--otlp-traces-endpoint over OTLP/gRPC"),
}


class MissingDependency(ConfigError):
    """A feature was used whose optional package is not installed (the CLI prints it as one line)."""


def registered(module: str) -> str:
    """The PACKAGES entry `module` belongs to: itself, or the longest entry it lies under (a.b.c under a.b)."""
    under = [key for key in PACKAGES if module == key or module.startswith(key + ".")]
    if not under:
        raise KeyError(f"{module} is not registered in nanoserve.optional.PACKAGES")
    return max(under, key=len)


def install_hint(module: str) -> str:
    return f"pip install 'nanoserve[{PACKAGES[registered(module)].extra}]'"


def available(module: str) -> bool:
    """Whether `module` imports (an import that fails for any reason counts as absent)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(module: str, feature: str) -> ModuleType:
    """`module` imported, or MissingDependency: '<feature> needs <package>, which is not installed: <how>'.

    A package that is there but fails to import (one of its own dependencies missing, say) is named as such,
    with its error, since installing it again would not help."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        key = registered(module)
        package, missing = PACKAGES[key], e.name or ""
        if not (missing == key or missing.startswith(key + ".") or key.startswith(missing + ".")):
            raise MissingDependency(f"{feature} needs {package.distribution}, which is installed but does not "
                                    f"import: {e}") from e
        raise MissingDependency(f"{feature} needs {package.distribution}, which is not installed: "
                                f"{install_hint(module)}") from e


def left_out(arm: str, module: str) -> str:
    """The line a benchmark prints when it runs without the arm that `module` would have given it."""
    return f"{arm} arm left out: {PACKAGES[module].distribution} is not installed ({install_hint(module)})"


def require_all(modules, feature: str) -> None:
    """`require` each of `modules` (a feature that needs several packages says the first missing one)."""
    for module in modules:
        require(module, feature)
