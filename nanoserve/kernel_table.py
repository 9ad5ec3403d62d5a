"""Kernel choices timed once per machine and kept, so every load on that machine picks the same kernel.

A kernel chosen by timing at load can change between two starts of the same engine on the same machine (a busy
neighbour is enough), and which kernel runs changes a model's last bits: two starts would answer differently.
Under batch invariance such a choice is timed once per machine kind (CPU model and flags), torch build and
thread count, and written to `cache_dir()/kernels.json` under a lock, so two engines starting together agree;
every later load reads it. Delete the file to time again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("nanoserve.kernels")


def machine_key() -> str:
    """What a timing depends on besides the shape: the CPU (model and flags), the machine, torch, the threads, and
    the instruction sets the kernels were capped to ($NANOSERVE_CPU_ISA, $ATEN_CPU_CAPABILITY)."""
    from nanoserve.kernels.build import isa_cap

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    capped = "" if isa_cap() == "native" else f" isa {isa_cap()}"  # the kernels built as a smaller machine's
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # torch's own kernels capped likewise
        capped += f" aten {torch.backends.cpu.get_cpu_capability()}"
    return f"{model} flags:{digest} torch {torch.__version__} threads {torch.get_num_threads()}{capped}"


def table_path() -> Path:
    from nanoserve.model.loader import cache_dir

    return cache_dir() / "kernels.json"


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock beside `path` (where the platform has one) while the table is read and written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): two engines starting at once may each time the kernel
            pass
        yield


def kept_choice(name: str, measure: Callable[[], dict]) -> dict:
    """The recorded choice `name` for this machine, measured by `measure` (a JSON-able dict) the first time."""
    path = table_path()
    try:
        with _locked(path):
            table = json.loads(path.read_text()) if path.exists() else {}
            entries = table.setdefault(machine_key(), {})
            if name not in entries:
                entries[name] = measure()
                scratch = path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_text(json.dumps(table, indent=1, sort_keys=True))
                scratch.replace(path)
            return entries[name]
    except (OSError, ValueError) as e:  # no writable cache, or a damaged table: time it now, say so
        log.warning("kernel table %s unusable (%s): timing %s for this load only", path, e, name)
        return measure()
