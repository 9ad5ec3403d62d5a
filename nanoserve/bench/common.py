"""Helpers every benchmark shares: printing a table, writing its rows as JSON and CSV, the machine it ran on, and
timing a buffer read. (Requests and their prompts: nanoserve/workload.py; the HTTP client: nanoserve/client.py.)"""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path

import torch

from nanoserve.timing import best_seconds


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e4 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def write_results(out_dir: str | os.PathLike, name: str, payload: dict, rows: list[dict], args=None) -> Path:
    """`name`.json (when, machine, the command's `args` without its handlers, then `payload`) and `name`.csv."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine()}
    if args is not None:
        header["args"] = {k: v for k, v in vars(args).items() if not callable(v)}
    payload = {**header, **payload}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    if rows:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return out / f"{name}.json"


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _first_cpu() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux), or {} where there is none to read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and the vector flags that decide which kernels are fast (Linux /proc/cpuinfo)."""
    fields = _first_cpu()
    flags = set(fields.get("flags", "").split())
    return fields.get("model name") or platform.processor() or platform.machine(), [f for f in _CPU_FLAGS if f in flags]


def cpu_generation() -> str | None:
    """x86's "family F model M" (/proc/cpuinfo), which tells CPU generations apart where a virtual machine names its
    CPU only "AMD EPYC" (family 25 is Zen 3 / Zen 4, 26 Zen 5); None where the system does not say."""
    fields = _first_cpu()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def machine() -> dict:
    model, flags = cpu_model_and_flags()
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": model, "cpu_generation": cpu_generation(), "cpu_flags": flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_bandwidth_gbs(mib: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Read bandwidth of `device` as this process sees it: the best of a few sums over a `mib` MiB buffer (beyond
    its caches; on CUDA each sum is waited for)."""
    device = torch.device(device)
    x = torch.ones(mib * 2**18, dtype=torch.float32, device=device)
    if device.type != "cuda":
        return x.nbytes / best_seconds(x.sum, repeats) / 1e9

    def summed() -> None:
        x.sum()
        torch.cuda.synchronize(device)

    return x.nbytes / best_seconds(summed, repeats) / 1e9
