"""The determinism property tests again, on the kernels an AVX2-only machine runs.

Many users' machines (and some of CI's) have AVX2 and no AVX-512: their C kernels take linear.c's and fused.c's
AVX2 paths and torch takes its AVX2 kernels. On a machine with AVX-512 those paths would go untested at the
engine level, so tests/test_determinism.py runs here once more in a child process with the kernels built as an
AVX2 machine builds them ($NANOSERVE_CPU_ISA=avx2) and torch, MKL and oneDNN capped to AVX2 alike. On an
AVX2-only machine the suite's own run is that run, and this one is skipped.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.bench.common import cpu_model_and_flags
from nanoserve.kernels.build import find_compiler

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"NANOSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 paths are x86-64's")
@pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the AVX2 kernels with")
@pytest.mark.skipif(not {"avx512f", "avx2"} <= set(cpu_model_and_flags()[1]),
                    reason="this machine's own kernels are the AVX2 (or narrower) ones: the suite's run covers them")
def test_the_determinism_properties_hold_on_the_avx2_paths(tmp_path):
    env = {**os.environ, **AVX2_ONLY, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                    os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/test_determinism.py", "tests/test_determinism_isa.py::test_the_child_runs_capped"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
    assert done.returncode == 0, tail
    assert " passed" in tail.splitlines()[-1], tail


def test_the_child_runs_capped():
    """In the child above: the kernels really are the AVX2 build and torch really runs its AVX2 kernels (else
    the run would re-test the native paths and prove nothing)."""
    if os.environ.get("NANOSERVE_CPU_ISA") != "avx2":
        pytest.skip("runs inside the capped child process")
    import torch

    from nanoserve.kernels.fused import load

    kernels, reason = load()
    assert kernels is not None, reason
    assert kernels.q4_isa == "avx2"
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
