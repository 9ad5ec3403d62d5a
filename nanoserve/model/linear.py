"""The decoder's projections and its vocabulary layers: each loads its own checkpoint weights and multiplies.

A projection holds its weight dense as loaded. After loading, where the weight came as a file's blocks (or a
--quantization mode asks), the linear method of that format (nanoserve/model/quant/methods.py) turns it into the
packed module the layer then runs (`packed`): the model keeps its layers and its one forward, and a new weight
format is a new method, not a new layer.

Each layer also says how tensor parallelism splits it (`parallel`): a column-parallel projection splits its output
rows, a row-parallel one its input columns (the model sums their partial outputs), the vocabulary layers their
rows (padded to a common width). The loader asks the layer which slice of a checkpoint tensor a rank holds
(`TensorShard.bounds`), so the split is a property of the layer, never of a checkpoint name.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.model.attrs import FastAttributes
from nanoserve.model.rescore import SHORTLIST, rescore_shortlist
from nanoserve.model.rows import linear_rows


class LinearLayer(FastAttributes, nn.Module):
    """y = x W^T (+ b): on the dense weight as loaded (its rows padded to `row_multiple`, nanoserve/model/rows.py),
    or on the packed module its linear method made of it after loading (`use_packed`)."""

    parallel: str | None = None  # how tensor parallelism splits the weight: "column", "row" or None (whole)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, row_multiple: int = 1):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.row_multiple = row_multiple
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.register_module("packed", None)  # the packed module that serves every call, once processed

    def use_packed(self, packed: nn.Module) -> None:
        """Serve every call from `packed` (its linear method's module, holding the weight in its own format and
        the bias): the dense weight is let go, since the packed module stands for it."""
        self.packed = packed
        self.weight = None
        self.bias = None

    @property
    def matmul_dtype(self) -> torch.dtype | None:
        """The dtype of the dense matmul this layer runs (None: a packed kernel, which pads no rows)."""
        if self.packed is not None:
            return getattr(self.packed, "matmul_dtype", None)
        return self.weight.dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype a caller should hand forward (the fused norm writes it directly)."""
        if self.packed is not None:
            return getattr(self.packed, "input_dtype", torch.float32)
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None:
            return packed.forward(x)
        return linear_rows(x, self.weight, self.bias, self.row_multiple)


class RowParallelLinear(LinearLayer):
    """A projection whose input columns tensor parallelism splits (o_proj, down_proj): each rank's output is a
    partial sum, which the model adds up across ranks."""

    parallel = "row"


class MergedColumnLinear(LinearLayer):
    """Several checkpoint projections stored as one weight (q, k, v; gate, up), so a step runs one larger
    matmul; tensor parallelism splits each shard's output rows.

    Each shard knows its row range; the loader calls `load_shard` with the checkpoint's name for it, and counts
    the projection loaded only when every shard in `offsets` (and each bias shard) has arrived.
    """

    parallel = "column"

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False, row_multiple: int = 1):
        super().__init__(in_features, sum(shards.values()), bias, row_multiple)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.offsets[name] = (start, start + rows)
            start += rows
        self.sizes = list(shards.values())

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        lo, hi = self.offsets[shard]
        target = getattr(self, kind)
        if target is None:
            raise ValueError(f"{shard}.{kind} given but this projection has no {kind}")
        if tensor.shape != target[lo:hi].shape:
            expected = tuple(target[lo:hi].shape)
            raise ValueError(f"{shard}.{kind} has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[lo:hi].copy_(tensor)


class VocabEmbedding(FastAttributes, nn.Embedding):
    """The token embedding; tensor parallelism gives each rank a slice of the vocabulary's rows. After loading it
    may look its rows up in a file's blocks instead (`use_blocks`), with no dense copy held."""

    parallel = "vocab"

    def reset_parameters(self) -> None:
        """Nothing: the weight always comes from a checkpoint, and torch's random init on the meta device would
        import its compiler stack (a second of every load)."""

    def use_blocks(self, rows_of: nn.Module) -> None:
        """Look rows up through `rows_of` (ids -> float32 rows, dequantized as asked: KQuantRows); the dense
        weight is let go (its dtype stays, for what reads the model's dtype from it)."""
        self.rows_of = rows_of
        self.weight.data = torch.empty(0, self.embedding_dim, dtype=self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows_of = self.__dict__.get("rows_of")
        if rows_of is not None:
            return rows_of(ids).to(self.weight.dtype)
        return super().forward(ids)


class LMHead(LinearLayer):
    """The output head: logits for the rows asked, in float32, over this rank's slice of the vocabulary.

    After loading it may run in a faster form than its weight as loaded (`use_packed`: a bfloat16 copy, the file's
    blocks; nanoserve/model/quant/install.py times them). A coarse form's logits are bfloat16-grained, so where the
    exact float32 weight is in memory anyway (a head tied to a float32 embedding) each row's SHORTLIST highest are
    recomputed from it (`exact`; nanoserve/model/rescore.py), on the fused kernels where the model runs them.
    """

    parallel = "vocab"

    def __init__(self, in_features: int, vocab: int, row_multiple: int = 1, kernels=None):
        super().__init__(in_features, vocab, False, row_multiple)
        self.kernels = kernels  # FusedKernels or None: chosen at load
        self.exact: torch.Tensor | None = None  # float32 rows a coarse form's shortlist is rescored by

    def use_packed(self, packed: nn.Module, exact: torch.Tensor | None = None) -> None:
        super().use_packed(packed)
        self.exact = exact

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden).float()
        if self.exact is None:
            return logits
        if self.kernels is not None:
            return self.kernels.rescore(logits.contiguous(), hidden, self.exact, SHORTLIST)
        return rescore_shortlist(logits, hidden, self.exact)
