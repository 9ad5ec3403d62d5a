"""Helpers every benchmark shares: printing a table and writing its rows as JSON and CSV."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path

import torch


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


def write_results(out_dir: str | os.PathLike, name: str, payload: dict, rows: list[dict]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    if rows:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return out / f"{name}.json"


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
