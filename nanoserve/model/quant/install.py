"""Installing the packed linears: which kernel serves which calls, the output head's form, and what is published.

`process_weights` has each decoder projection's linear method (methods.py) pack its weights after loading; `dense_crossover` measures, once
per weight shape and process, from how many rows a dense bfloat16 copy beats the packed kernel; `fastest_head`
times the forms the output head can take. QuantStats is the `linear` section of the stats snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.model.linear import LinearLayer, MergedColumnLinear
from nanoserve.model.quant.blocks import (
    GROUP,
    GgufInt4Rows,
    Int4Blocks,
    Int8Blocks,
    KQuantBlocks,
    QuantBlocks,
)
from nanoserve.model.quant.linears import (
    ACT,
    BF16Linear,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    KQuantLinear,
    KQuantRows,
    PackedLinear,
    Q8Linear,
    int4_packable,
)
from nanoserve.model.quant.methods import method_for, quantizing_method
from nanoserve.model.rescore import SHORTLIST
from nanoserve.timing import best_seconds

ROW_PROBES = (1, 2, 4, 8, 16, 32, 64, 128)  # call widths timed once per weight shape to find the crossover

_CROSSOVERS: dict[tuple, int | None] = {}  # (format, out, in, threads) -> rows, measured once a process


KEPT_REPEATS = 15  # a choice kept for the machine is timed once: with more care than one for a single load
DENSE_MARGIN = 0.85  # the dense copy must take at most this share of the packed kernel's time to be chosen


def dense_crossover(linear: PackedLinear, weight: torch.Tensor, repeats: int = 5) -> int | None:
    """The fewest rows from which a dense bf16 matmul beats the packed kernel on this machine, timed once per
    format, weight shape and process (about a millisecond per probe); None when the packed kernel always wins.

    A width counts only when the dense copy wins there and at the next width too, by DENSE_MARGIN, each time
    the best of `repeats`: a probe that a busy neighbour slowed must not send every call to the dense copy.
    Kept for the process: which kernel serves a call changes its last bits, so two engines in one process (an
    A/B run, a restart) must choose alike or a switch under test would seem to change the output.
    """
    key = (linear.format, linear.out_features, linear.in_features, torch.get_num_threads())
    if key not in _CROSSOVERS:
        dense = weight.to(ACT)

        def dense_wins(rows: int) -> bool:
            x = torch.randn(rows, linear.in_features, dtype=ACT)
            packed = best_seconds(lambda: linear.packed_mm(x), repeats)
            return best_seconds(lambda: torch.nn.functional.linear(x, dense), repeats) < DENSE_MARGIN * packed

        wins = [dense_wins(rows) for rows in ROW_PROBES]
        _CROSSOVERS[key] = next((rows for rows, here, after in zip(ROW_PROBES, wins, [*wins[1:], True])
                                 if here and after), None)
    return _CROSSOVERS[key]


_HEADS: dict[tuple, dict[str, float]] = {}  # (shape, dtype, threads, forms) -> seconds a row, once a process


def head_forms(weight: torch.Tensor, blocks: QuantBlocks | None, mode: str, kernels=None,
               bf16_rows: int = 1) -> dict:
    """The forms the output head can take, each a builder: a bfloat16 copy; the file's own blocks when the head
    (or the embedding it is tied to) came quantized (int8g32 for Q8_0, int4 for Q4); and int8 per row, which
    re-rounds the weight, only when --quantization int4 / int8 asked for lossy weights. With `kernels` the file's
    8-bit blocks run on the fused library's 8-bit kernel (q8x16) where it is vectorized, else on its 4-bit kernel as
    two planes. `bf16_rows`: the bfloat16 copy's row multiple (nanoserve/model/rows.py)."""
    forms = {"bfloat16": lambda: BF16Linear(weight, bf16_rows)}
    if blocks is not None and not isinstance(blocks, KQuantBlocks) and not int4_packable(*blocks.shape):
        blocks = None
    if isinstance(blocks, KQuantBlocks) and kernels is not None and blocks.shape[1] % blocks.unit == 0:
        forms["kquant"] = lambda: KQuantLinear(blocks, None, None, kernels)
    elif isinstance(blocks, Int8Blocks) and kernels is not None and kernels.q8_vectorized:
        forms["q8x16"] = lambda: Q8Linear(blocks, None, None, kernels)
    elif isinstance(blocks, Int8Blocks):
        forms["int8g32"] = lambda: Int8GroupLinear(blocks, kernels=kernels)
    elif isinstance(blocks, (Int4Blocks, GgufInt4Rows)):
        forms["int4"] = lambda: Int4Linear(blocks, None)
    if mode in ("int4", "int8") and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        forms["int8"] = lambda: Int8Linear(weight)
    return forms


def head_timings(weight: torch.Tensor, forms: dict, repeats: int = 3) -> dict[str, float]:
    """Seconds for one row through the head in its own dtype ("own") and in each of `forms`, measured once a
    process per shape and set of forms (so two engines in one process choose alike)."""
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads(), tuple(forms))
    if key not in _HEADS:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
        times = {"own": best_seconds(lambda: torch.nn.functional.linear(x, weight), repeats)}
        for name, build in forms.items():
            head = build()
            times[name] = best_seconds(lambda head=head: head(x), repeats)
        _HEADS[key] = times
    return _HEADS[key]


def fastest_head(weight: torch.Tensor, blocks: QuantBlocks | None = None, mode: str = "auto",
                 repeats: int = 3) -> str:
    """Which form runs one row through the head fastest here ("own" = the dense weight as loaded)."""
    times = head_timings(weight, head_forms(weight, blocks, mode), repeats)
    return min(times, key=times.get)


@dataclass
class QuantStats:
    """What the quantized seam holds and did: published as the `linear` section of the stats snapshot."""

    formats: dict[str, int]  # format -> projections packed in it
    packed_bytes: int
    dense_bytes: int  # the bf16 copies kept for wide calls, and the head's own form
    dense_from_rows: dict[str, int | None]  # "format out x in" -> rows from which the dense copy serves
    calls: dict[str, int]  # calls each kernel served, counted by the modules as they dispatch
    rows: dict[str, int]  # the rows (tokens) of those calls, by kernel
    head: str  # the form the output head runs in (see head_forms), or the model's dtype where that was fastest
    head_us: dict[str, float]  # the measurement behind `head`: microseconds a row in each form ("own" = as loaded)
    head_rescored: int = 0  # each row's highest logits recomputed in float32 (nanoserve/model/rescore.py); 0: none

    def as_dict(self) -> dict:
        kinds = sorted(self.formats)
        return {"format": kinds[0] if len(kinds) == 1 else "+".join(kinds), "group": GROUP,
                "modules": sum(self.formats.values()), **{f"{k}_modules": n for k, n in self.formats.items()},
                "packed_bytes": self.packed_bytes, "dense_bytes": self.dense_bytes,
                "dense_from_rows": dict(self.dense_from_rows),
                **{f"{k}_calls": n for k, n in self.calls.items()},
                "rows_by_kernel": {k: n for k, n in self.rows.items() if k in self.formats or k == "dense"},
                "head": self.head,
                "head_us": dict(self.head_us),
                "head_rescored": self.head_rescored}


def _timed_head(weight: torch.Tensor, forms: dict, repeats: int = 3) -> tuple[str, dict[str, float]]:
    """The head's fastest form timed now, and the microseconds a row behind the choice."""
    times = head_timings(weight, forms, repeats)
    return min(times, key=times.get), {name: round(t * 1e6, 1) for name, t in times.items()}


def _kept_head(weight: torch.Tensor, forms: dict) -> tuple[str, dict[str, float]]:
    """The head's form as first timed on this machine (kernel_table), so every load picks the same one."""
    from nanoserve.kernel_table import kept_choice

    name = f"head {'x'.join(map(str, weight.shape))} {str(weight.dtype).removeprefix('torch.')} {'|'.join(forms)}"

    def measure() -> dict:
        head, us = _timed_head(weight, forms, repeats=KEPT_REPEATS)
        return {"choice": head, "us": us}

    kept = kept_choice(name, measure)
    return kept["choice"], kept["us"]


def _decoder_linears(model: nn.Module) -> list[tuple[str, LinearLayer]]:
    """Each projection of the decoder layers, by path."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, LinearLayer) and p.startswith("layers.")]


def _shard_names(layer: LinearLayer) -> list[str]:
    """The checkpoint weights a projection is made of: a merged projection's shards, else its one weight."""
    return list(layer.offsets) if isinstance(layer, MergedColumnLinear) else ["weight"]


def _stays_dense(layer: LinearLayer, shards: dict[str, QuantBlocks], kernels=None) -> bool:
    """Blocks arrived for a projection no method runs as one: some shards dense, 4-bit beside 8-bit, a format
    no kernel here runs, or a shape the format's kernel cannot take."""
    if not shards:
        return False
    mixed = set(shards) != set(_shard_names(layer)) or len({type(b) for b in shards.values()}) > 1
    method = method_for(next(iter(shards.values())), kernels)
    return mixed or not method.packs(layer.out_features, layer.in_features)


def _write_dense(layer: LinearLayer, shards: dict[str, QuantBlocks]) -> None:
    """Each shard's blocks, dequantized into the layer's own dense weight."""
    for shard, blocks in shards.items():
        dense_weight = blocks.dequantize().to(layer.weight.dtype)
        if isinstance(layer, MergedColumnLinear):
            layer.load_shard(shard, "weight", dense_weight)
        else:
            layer.weight.data.copy_(dense_weight)


def _processed(layer: LinearLayer, shards: dict[str, QuantBlocks], mode: str,
               kernels=None) -> tuple[PackedLinear, Callable[[], torch.Tensor]] | None:
    """The packed module a projection's linear method makes of its weights, and how to make the dense weight it
    stands for (asked for only where a dense copy may serve wide calls): the file's blocks where they came, else
    the weight quantized at load under mode "int4" / "int8"; None when it stays as it is."""
    bias, sizes = (layer.bias.data if layer.bias is not None else None), getattr(layer, "sizes", None)
    if shards:
        parts = [shards[n] for n in _shard_names(layer)]
        blocks = type(parts[0]).cat(parts)
        return method_for(blocks, kernels).process(blocks, bias, sizes), blocks.dequantize
    chosen = quantizing_method(mode, layer.weight.data, kernels)
    if chosen is None:
        return None
    method, weights = chosen
    packed = method.process(weights, bias, sizes)
    return packed, weights.dequantize if isinstance(weights, QuantBlocks) else packed.dequantize


def _install_head(model: nn.Module, blocks: QuantBlocks | None, mode: str,
                  invariant: bool, kernels=None, bf16_rows: int = 1) -> tuple[str, dict[str, float], int]:
    """Put the output head in its fastest form (kept for the machine under `invariant`). Returns the form's name
    (the model's dtype when the head stays as loaded), the microseconds behind the choice, and the bytes the new
    form holds (0 when it stays)."""
    weight = model.lm_head.weight
    if isinstance(blocks, KQuantBlocks):  # no dense copy was read: the file's blocks are the head
        return _blocks_head(model, blocks, kernels)
    forms = head_forms(weight, blocks, mode, kernels, bf16_rows)
    head, head_us = _kept_head(weight, forms) if invariant else _timed_head(weight, forms)
    if head == "own":
        return str(weight.dtype).removeprefix("torch."), head_us, 0
    form = forms[head]()
    model.lm_head.use_packed(form, _exact_rows(model, weight))
    nbytes = sum(b.numel() * b.element_size() for b in form.buffers())
    return head, head_us, nbytes


def _blocks_head(model: nn.Module, blocks: KQuantBlocks, kernels=None) -> tuple[str, dict[str, float], int]:
    """A head that came as K-quant blocks alone runs on them where the kernels take them; elsewhere they are
    dequantized into its weight (a tied head's is the embedding's, already written by _install_embedding)."""
    if kernels is None or blocks.shape[1] % blocks.unit:
        if model.lm_head.weight.numel() == 0 or model.lm_head.weight is not model.embed_tokens.weight:
            model.lm_head.weight.data = blocks.dequantize().to(model.lm_head.weight.dtype)
        return str(model.lm_head.weight.dtype).removeprefix("torch."), {}, 0
    rows_of = getattr(model.embed_tokens, "rows_of", None)
    form = KQuantLinear(blocks, None, None, kernels)
    model.lm_head.use_packed(form)
    if isinstance(rows_of, KQuantRows) and rows_of.raw.data_ptr() == blocks.segments[0][1].data_ptr():
        model.embed_tokens.use_blocks(KQuantRows.of_head(form))  # tied: one table, the head's
    return "kquant", {}, sum(b.numel() * b.element_size() for b in form.buffers())


def _install_embedding(model: nn.Module, blocks: QuantBlocks | None, kernels=None) -> None:
    """An embedding that came as K-quant blocks looks its rows up in them where the kernels run (no dense copy),
    else is written dequantized into its weight."""
    if blocks is None:
        return
    embedding = model.embed_tokens
    if kernels is not None and isinstance(blocks, KQuantBlocks) and blocks.shape[1] % blocks.unit == 0:
        embedding.use_blocks(KQuantRows(blocks, kernels))
    else:
        embedding.weight.data = blocks.dequantize().to(embedding.weight.dtype)


def process_weights(model: nn.Module, kept: dict[str, dict[str, QuantBlocks]], mode: str,
                    invariant: bool = False, kernels=None, bf16_rows: int = 1) -> QuantStats | None:
    """After loading: each decoder projection whose weights arrived as blocks (`kept`: module path -> shard ->
    blocks) is processed by the linear method of their format (nanoserve/model/quant/methods.py) and runs on
    its packed module from then on; under mode "int4" or "int8" every other decoder projection is quantized at
    load to that format. A merged projection whose shards arrived in different forms (some dense, or 4-bit
    beside 8-bit) stays dense: its blocks are written dequantized. The output head takes the fastest of its
    forms (see head_forms); blocks kept for it under "lm_head" are the file's own. Returns None when no
    projection is packed.

    `invariant` (batch invariance): every call runs the packed kernel whatever its rows (a dense copy for wide
    calls would give a row other numbers beside many rows than alone), and the head's form is timed once per
    machine and kept (nanoserve/kernel_table.py), not timed at each load. `kernels` (FusedKernels): the methods
    run on its kernels instead of torch's. `bf16_rows`: the row multiple of a bfloat16 head
    (nanoserve/model/rows.py)."""
    _install_embedding(model, kept.get("embed_tokens", {}).get("weight"), kernels)
    calls = {"int4": 0, "q4x16": 0, "q4x8": 0, "q8x16": 0, "int8": 0, "int8g32": 0, "kquant": 0, "dense": 0}
    served_rows = dict.fromkeys(calls, 0)
    formats: dict[str, int] = {}
    crossover: dict[str, int | None] = {}
    packed = dense = 0
    for path, layer in _decoder_linears(model):
        shards = kept.pop(path, {})  # let go once packed: the file's pages it maps leave the process with it
        if _stays_dense(layer, shards, kernels):
            _write_dense(layer, shards)
            continue
        built = _processed(layer, shards, mode, kernels)
        if built is None:
            continue
        linear, dense_weight = built
        if invariant:
            rows = None
        else:
            weight = dense_weight()
            rows = dense_crossover(linear, weight)
            linear.use_dense_from(rows, weight)
        crossover[f"{linear.format} {linear.out_features}x{linear.in_features}"] = rows
        linear.calls, linear.rows = calls, served_rows  # one tally for all: the snapshot reads it without a walk
        layer.use_packed(linear)
        formats[linear.format] = formats.get(linear.format, 0) + 1
        packed += sum(b.numel() * b.element_size() for b in linear.buffers())
        dense += linear.dense.numel() * 2 if linear.dense is not None else 0
    if not formats:
        head_blocks = kept.get("lm_head", {}).get("weight")
        if isinstance(head_blocks, KQuantBlocks):  # no kernel runs it: its blocks dequantized into the weight
            _blocks_head(model, head_blocks, None)
        return None
    head, head_us, head_bytes = _install_head(model, kept.get("lm_head", {}).get("weight"), mode, invariant,
                                              kernels, bf16_rows)
    rescored = 0 if model.lm_head.exact is None else SHORTLIST
    return QuantStats(formats, packed, dense + head_bytes, crossover, calls, served_rows, head, head_us, rescored)


def _exact_rows(model: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The float32 weight a coarse head's shortlist is rescored by (nanoserve/model/rescore.py): the embedding
    a tied head shares, already in memory; None for an untied head, whose float32 copy would cost its size again."""
    tied = weight is model.embed_tokens.weight
    return weight if tied and weight.dtype == torch.float32 and weight.numel() else None
