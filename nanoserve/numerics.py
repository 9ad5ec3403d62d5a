"""What the built engine computes in: its weights' forms, its activations' dtypes and its KV cache's dtype.

Read off the modules the load actually installed, not off the flags: `--dtype auto` on the CPU with a Q4_1 file
runs int4 linears on bfloat16 activations around a float32 model, and a header that said "float32" would hide it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from nanoserve.model.linear import LinearLayer
from nanoserve.model.quant.linears import ACT, BF16Linear, PackedLinear
from nanoserve.model.rescore import SHORTLIST
from nanoserve.stats import Numerics


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _form(module: nn.Module) -> str:
    """A projection's weight form: its packed module's format, the bfloat16 copy, or its weight's dtype."""
    if isinstance(module, LinearLayer) and module.packed is not None:
        return _form(module.packed)
    if isinstance(module, PackedLinear):
        return module.format
    if isinstance(module, BF16Linear):
        return _name(ACT)
    return _name(module.weight.dtype)


def numerics_of(model: nn.Module, kv_dtype: torch.dtype, determinism: str = "") -> Numerics:
    """`model` as loaded (a decoder with `layers`, `embed_tokens`, `lm_head`), its KV cache's dtype, and what
    the engine says of its determinism (see Engine)."""
    model_dtype = _name(model.embed_tokens.weight.dtype)
    linears = Counter(_form(m) for m in model.layers.modules() if isinstance(m, LinearLayer))
    main = "+".join(form for form, _ in linears.most_common()) or model_dtype
    head = _form(model.lm_head)
    if model.lm_head.exact is not None:
        head += f" + {_name(model.lm_head.exact.dtype)} top {SHORTLIST}"
    others = [f"{part} {form}" for part, form in (("head", head), ("rest", model_dtype)) if form != main]
    weights = main + (f" ({', '.join(others)})" if others else "")
    cast = [m for m in model.modules() if isinstance(m, PackedLinear | BF16Linear)]
    activations = model_dtype
    forms = sorted({getattr(m, "activation_form", _name(ACT)) for m in cast})
    if cast and forms != [model_dtype]:
        where = "linears" if any(isinstance(m, PackedLinear) for m in cast) else "the head"
        activations = f"{'+'.join(forms)} in {where}, {model_dtype}"
    return Numerics(weights, activations, _name(kv_dtype), determinism)
