"""Triton's process-wide mode, chosen once, before anything can import Triton.

Triton reads TRITON_INTERPRET when it is first imported (torch may import it lazily, through torch._dynamo), and
without CUDA its interpreter is the only way its kernels run. This module imports nothing of the engine, so a
kernel module can read the choice without pulling the package in; the package root imports it first.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton imported before this, outside its interpreter, cannot run the streamed read on a CPU (it says so).
COMPILED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
