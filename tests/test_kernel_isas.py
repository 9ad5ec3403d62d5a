"""The C kernels give the same bits on every instruction set they are built for.

tests/kernel_bits.c runs every kernel (each GGUF type's dot product at 1, 3, 8 and 11 rows, the 4-bit, 8-bit and
Q4_0 packed kernels, the norm, silu and the paged attention) on fixed pseudo-random inputs and prints a hash of
each case's output bits. It is built with the kernels' own flags for each instruction set this machine can run:
x86-64's native build, AVX2 and plain C; aarch64's plain C and NEON dotprod builds under qemu-user when the cross
compiler and qemu are installed (Debian: gcc-aarch64-linux-gnu qemu-user), natively on an ARM machine. Every
build must print the same lines, and each must have taken the path it was built for (a vector build that fell back
to plain C would agree with plain C and prove nothing).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from nanoserve.kernels import build

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "nanoserve" / "kernels"
HARNESS = ROOT / "tests" / "kernel_bits.c"
X86 = platform.machine() in ("x86_64", "AMD64")
ARM = platform.machine() in ("aarch64", "arm64")
CROSS_ARM = "aarch64-linux-gnu-gcc"
QEMU_ARM = "qemu-aarch64"


def flags() -> list[str]:
    """The kernels' own compile flags (nanoserve.kernels.build), for an executable instead of a library, with no
    -march: each build names its own"""
    return [f for f in build.FLAGS if f not in ("-shared", "-fPIC", "-march=native")]


def compile_harness(tmp_path: Path, name: str, compiler: str, extra: list[str]) -> Path:
    out = tmp_path / name
    sources = [str(KERNELS / s) for s in build.SOURCES] + [str(HARNESS)]
    done = subprocess.run([compiler, *flags(), *extra, *sources, "-o", str(out), "-lm"], capture_output=True,
                          text=True, timeout=build.COMPILE_TIMEOUT_S)
    assert done.returncode == 0, f"{name} did not build:\n{done.stderr[-3000:]}"
    return out


def run(program: Path, *args: str, runner: list[str] = ()) -> str:
    done = subprocess.run([*runner, str(program), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{program.name} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def host_builds() -> list[tuple[str, list[str], str]]:
    """(name, flags, the paths it must take) for this machine's builds beyond plain C"""
    if X86:
        return [("x86 native", ["-march=native"], ""),
                ("x86 avx2", ["-march=native", *build.ISA_CAPS["avx2"]], "avx2")]
    return [("native", ["-march=native"], "")]


def plain_c_flags() -> list[str]:
    return ["-march=native", *build.ISA_CAPS["portable"]] if X86 else ["-march=armv8-a"] if ARM else []


@pytest.fixture(scope="module")
def plain_c(tmp_path_factory) -> str:
    """This machine's plain C build's lines: the reference every other build must print"""
    if build.find_compiler() is None:
        pytest.skip("no C compiler")
    program = compile_harness(tmp_path_factory.mktemp("plain"), "plain-c", build.find_compiler(), plain_c_flags())
    assert run(program, "--isa").strip() == "kquant portable, q4 portable, q4x8 portable, kx16 portable"
    lines = run(program)
    assert len(lines.splitlines()) > 50 and "failed" not in lines, lines
    return lines


def same_as(reference: str, name: str, program: Path, path: str, runner: list[str] = ()) -> None:
    isa = run(program, "--isa", runner=runner).strip()
    if path:
        assert isa == f"kquant {path}, q4 {path}, q4x8 {path}, kx16 {path}", f"{name} took {isa}"
    text = run(program, runner=runner)
    differing = [f"{a}  vs  {b}" for a, b in zip(reference.splitlines(), text.splitlines()) if a != b]
    assert text == reference, f"{name} ({isa}) differs from plain C:\n" + "\n".join(differing)


@pytest.mark.parametrize("name, extra, path", host_builds(), ids=lambda v: v if isinstance(v, str) else None)
def test_this_machines_vector_builds_give_plain_cs_bits(plain_c, tmp_path, name, extra, path):
    same_as(plain_c, name, compile_harness(tmp_path, "build", build.find_compiler(), extra), path)


@pytest.mark.skipif(ARM or not (shutil.which(CROSS_ARM) and shutil.which(QEMU_ARM)),
                    reason=f"the aarch64 builds run under qemu-user: they need {CROSS_ARM} and {QEMU_ARM} (Debian: "
                           "apt-get install gcc-aarch64-linux-gnu qemu-user); on an ARM machine the native test runs")
@pytest.mark.parametrize("name, extra, path", [("arm plain C", ["-march=armv8-a"], "portable"),
                                               ("arm neon-dotprod", ["-march=armv8.2-a+dotprod"], "neon-dotprod")])
def test_the_aarch64_builds_give_plain_cs_bits_under_qemu(plain_c, tmp_path, name, extra, path):
    program = compile_harness(tmp_path, "build", CROSS_ARM, [*extra, "-static"])
    same_as(plain_c, name, program, path, runner=[QEMU_ARM])
