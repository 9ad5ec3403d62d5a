"""Compile nanoserve's C kernels once per machine and keep the library in the user's cache.

The library is built for this CPU (-march=native), so its name carries a hash of the source, the compiler, the
flags and the CPU's feature list: a home directory shared between machines never hands one machine another's
build. Nothing here is needed for correctness; without a C compiler the eager torch ops run instead, and the
reason is published (`stats().features["fused"]`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

# -fno-trapping-math: floating-point operations may be computed where the source has a branch around them (the
# compiler's if-conversion), which vectorizes loops with clamps (silu's and the softmax's exp: 0 -> 32-byte
# vectors); no value changes, only floating-point exception flags, which nothing here reads
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c11", "-shared",
         "-fPIC", "-pthread")
COMPILE_TIMEOUT_S = 120
# $NANOSERVE_CPU_ISA builds the kernels as a machine with less would: an AVX-512 or AMX machine then runs (and
# its tests cover) the AVX2 or the plain-C path that other users' machines take. The flags follow -march=native.
ISA_CAPS = {
    "native": (),
    "avx2": ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mavx2", "-mfma", "-mf16c"),
    "portable": ("-mno-avx", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
}


def isa_cap() -> str:
    """The instruction set the kernels are built for: $NANOSERVE_CPU_ISA, else "native" (all this CPU has)."""
    cap = os.environ.get("NANOSERVE_CPU_ISA", "native") or "native"
    if cap not in ISA_CAPS:
        raise ValueError(f"NANOSERVE_CPU_ISA={cap!r} is not one of {', '.join(ISA_CAPS)}; unset it to build for "
                         "this CPU")
    return cap


def compile_flags() -> tuple[str, ...]:
    """FLAGS, then the ones $NANOSERVE_CPU_ISA takes away (x86-64 only: elsewhere native is the one build)."""
    cap = isa_cap()
    if cap != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"NANOSERVE_CPU_ISA={cap} names an x86-64 build, and this machine is {platform.machine()}")
    return FLAGS + ISA_CAPS[cap]


def cache_dir() -> Path:
    from nanoserve.model.loader import cache_dir as nanoserve_cache

    return nanoserve_cache() / "kernels"


def find_compiler() -> str | None:
    """$CC when set, else the first of cc, gcc, clang on PATH."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named) or named
    return next((path for path in map(shutil.which, ("cc", "gcc", "clang")) if path), None)


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


SOURCES = ("fused.c", "linear.c", "kquant.c", "kdecode.c", "q4x8.c", "kx16.c")  # compiled together into one library
# what they include: part of the build's key
HEADERS = ("half.h", "kdecode.h", "q4pack.h", "kquant_x86.h", "kquant_avx512.h", "kquant_avx2.h", "kquant_neon.h",
           "kquant_plainc.h", "kx16_avx512.h", "kx16_avx2.h", "kx16_neon.h", "kx16_plainc.h")


def library_path(source: bytes, compiler: str) -> Path:
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(compile_flags()).encode(),
                                     platform.machine().encode(), _cpu_features().encode()])).hexdigest()[:16]
    return cache_dir() / f"fused-{key}.so"


def self_test_failure(library: Path) -> str:
    """Why a fresh build cannot run here ("" when its self-test passes), tried in a child process: a library
    compiled for an instruction this CPU (or its hypervisor) does not offer kills the process that runs it."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).ns_self_test())"
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(library)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
    except subprocess.SubprocessError as exc:
        return f"could not be tried: {exc}"
    if done.returncode == 0:
        return ""
    if done.returncode < 0:
        return f"crash in their self-test (signal {-done.returncode})"
    return "fail their self-test (a kernel returned a non-finite number)"


def build(names: tuple[str, ...] = SOURCES) -> tuple[Path | None, str]:
    """(path of the compiled library, "") or (None, why not). Compiles only when no build for these sources,
    compiler and CPU is cached; the file appears atomically, so concurrent starts never load half a library."""
    compiler = find_compiler()
    if compiler is None:
        return None, "no C compiler (install gcc or clang, or set CC)"
    files = {name: resources.files("nanoserve.kernels").joinpath(name).read_bytes() for name in (*names, *HEADERS)}
    target = library_path(b"\0".join(files.values()), compiler)
    name = " + ".join(names)
    if target.exists():
        return target, ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            out = Path(work) / target.name
            for file_name, text in files.items():
                (Path(work) / file_name).write_bytes(text)
            command = [compiler, *compile_flags(), *(str(Path(work) / n) for n in names), "-o", str(out), "-lm"]
            done = subprocess.run(command,
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no message"])[0]
                return None, f"{compiler} failed on {name}: {first}"
            failed = self_test_failure(out)
            if failed:
                return None, f"the kernels {compiler} built for this CPU {failed}"
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building {name} with {compiler} failed: {exc}"
    return target, ""
