"""Compile every Triton kernel of nanoserve for sm_80 and sm_90 without a GPU (run in its own process: Triton
must be imported outside its interpreter, which nanoserve chooses on machines without CUDA).

Prints one line per kernel variant and target; exits non-zero on the first one that does not compile.
"""

from __future__ import annotations

import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports Triton

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanoserve.attention import streamed  # noqa: E402

POINTERS = {"Table": "*i64", "Lens": "*i64", "Acc": "*fp32", "Max": "*fp32", "Sum": "*fp32"}
SCALARS = {"scale": "fp32"}
# (cache dtype, F32_DOT, GROUP, G_PAD, D, BLOCK, SPLITS): float32 caches dot in float32, half caches in their own
VARIANTS = [("fp32", True, 3, 16, 64, 64, 1), ("bf16", False, 4, 16, 128, 64, 4), ("fp16", False, 8, 16, 64, 16, 2)]


def signature(fn, cache: str, constants: dict) -> dict:
    """The kernel's own parameters typed: a parameter this table does not know fails here, not on a GPU."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V"):
            sig[name] = f"*{cache}"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        elif name.startswith("stride_") or name in ("block_size", "tiles_per_split"):
            sig[name] = "i32"
        else:
            raise SystemExit(f"unknown kernel parameter {name!r}: type it in tests/triton_aot.py")
    return sig


def main() -> int:
    fn = streamed._streamed_decode
    for cache, f32_dot, group, g_pad, d, block, splits in VARIANTS:
        constants = {"GROUP": group, "G_PAD": g_pad, "D": d, "BLOCK": block, "SPLITS": splits, "F32_DOT": f32_dot}
        for capability in (80, 90):
            src = ASTSource(fn=fn, signature=signature(fn, cache, constants), constexprs=constants)
            kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32))
            print(f"_streamed_decode {cache} D={d} BLOCK={block} sm_{capability}: "
                  f"{len(kernel.asm['cubin'])} bytes of cubin", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
