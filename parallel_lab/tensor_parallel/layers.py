"""Column- and row-parallel linear layers, and the Megatron MLP built from them.

Shoeybi et al. 2019 (Megatron-LM), §3, Fig. 3a. For Y = GeLU(X A) B:

- A split by columns: each rank computes GeLU(X A_r) on its own columns. GeLU is
  elementwise, so no communication is needed before it.
- B split by rows: rank r multiplies its columns of the hidden activation by its rows
  of B, giving a partial sum of the whole output; one all-reduce (g) finishes it.
  Backward mirrors it: one all-reduce (f) of the input gradient.

`RowFirstMLP` is the other order (A by rows, B by columns). The partial sums must be
added *before* GeLU, because GeLU(a + b) != GeLU(a) + GeLU(b): an all-reduce of the
4h-wide hidden activation, then an all-gather of the column-split output; backward
pays the same again. It exists to measure that cost.

Invariant: a layer built `from_linear` / `from_mlp` computes what the full layer
computes; its parameters are this rank's shards (`column_shard` / `row_shard` of the
full ones), so a tp=1 layer is the single-process layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.tensor_parallel.operators import (
    check_divisible,
    check_impl,
    column_shard,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    row_shard,
    scatter_to_tp_region,
    tp_size_rank,
)
from parallel_lab.tensor_parallel.sequence_parallel import (
    gather_from_sequence_region,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_region,
    sequence_parallel_linear,
)


def _full_init(out_f: int, in_f: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nn.Linear's default init of the *full* weight from `seed`: every tp size gets the same model."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(out_f, in_f)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
    bound = 1 / math.sqrt(in_f)
    b = torch.empty(out_f).uniform_(-bound, bound, generator=gen) if bias else None
    return w, b


def _copy_param(param: nn.Parameter, value: torch.Tensor, like: nn.Parameter) -> None:
    """param <- value (a shard of `like`); a frozen full parameter gives a frozen shard."""
    with torch.no_grad():
        param.copy_(value)
    param.requires_grad_(like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: this rank holds out_features/tp output features (rows of the full weight).

    The input is replicated (f in front: identity forward, all-reduce backward) or, with
    `sequence_parallel`, this rank's tokens (all-gather forward, reduce-scatter backward).
    The output stays split (B, T, out/tp) unless `gather_output` (all-gather).
    `partitions` > 1 splits a fused projection (q, k, v stacked) block by block.
    `regather` (sequence parallel only): keep just this rank's tokens for the weight
    gradient and all-gather them again in backward.
    """

    def __init__(
        self,
        ctx,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Any = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        regather: bool = False,
        partitions: int = 1,
        impl: str = "ring",
        seed: int | None = None,
    ):
        super().__init__()
        self.ctx, self.group, self.impl = ctx, group, check_impl(impl)
        self.tp, self.tp_rank = tp_size_rank(ctx, group)
        check_divisible("in_features", in_features, 1)
        check_divisible("out_features", out_features, partitions, f"partitions ({partitions})")
        per = out_features // partitions  # e.g. q, k and v each: every one is split over the ranks
        check_divisible("out_features" if partitions == 1 else f"out_features / {partitions}", per, self.tp)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel cannot both be set")
        self.in_features, self.out_features, self.partitions = in_features, out_features, partitions
        self.gather_output, self.sequence_parallel, self.regather = gather_output, sequence_parallel, regather
        w, b = _full_init(out_features, in_features, bias, ctx.seed if seed is None else seed)
        dev = ctx.device
        self.weight = nn.Parameter(column_shard(w, self.tp, self.tp_rank, partitions).to(dev))  # (out/tp, in)
        self.bias = nn.Parameter(column_shard(b, self.tp, self.tp_rank, partitions).to(dev)) if bias else None

    @classmethod
    def from_linear(cls, ctx, linear: nn.Linear, group: Any = None, **kw: Any) -> ColumnParallelLinear:
        """This rank's shard of a full `nn.Linear` (its weight and bias are copied, not shared)."""
        layer = cls(ctx, linear.in_features, linear.out_features, linear.bias is not None, group, **kw)
        p, r, k = layer.tp, layer.tp_rank, layer.partitions
        _copy_param(layer.weight, column_shard(linear.weight.detach(), p, r, k), linear.weight)
        if linear.bias is not None:
            _copy_param(layer.bias, column_shard(linear.bias.detach(), p, r, k), linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, grp, impl = self.ctx, self.group, self.impl
        if self.sequence_parallel:
            if self.regather:
                return sequence_parallel_linear(ctx, x, self.weight, self.bias, grp, impl)  # (B, T, out/tp)
            x = gather_from_sequence_region(ctx, x, grp, impl)  # (B, T/tp, in) -> (B, T, in)
        else:
            x = copy_to_tp_region(ctx, x, grp, impl)  # f: (B, T, in), all-reduce in backward
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/tp)
        if self.gather_output:
            y = gather_from_tp_region(ctx, y, grp, impl)  # (B, T, out)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.tp}, sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r: this rank holds in_features/tp input features (columns of the full weight).

    The input is split along its last dim (`input_is_parallel`, the usual case after a
    ColumnParallelLinear) or replicated and split here. The partial sums are added by g
    (all-reduce) or, with `sequence_parallel`, reduce-scattered onto this rank's tokens.
    The bias is added once, after the sum (replicated; with sequence parallelism its
    gradient needs `sync_sequence_parallel_grads`).
    """

    def __init__(
        self,
        ctx,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Any = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        impl: str = "ring",
        seed: int | None = None,
    ):
        super().__init__()
        self.ctx, self.group, self.impl = ctx, group, check_impl(impl)
        self.tp, self.tp_rank = tp_size_rank(ctx, group)
        check_divisible("out_features", out_features, 1)
        check_divisible("in_features", in_features, self.tp)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel needs input_is_parallel=True (the input comes split by features)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        w, b = _full_init(out_features, in_features, bias, ctx.seed if seed is None else seed)
        self.weight = nn.Parameter(row_shard(w, self.tp, self.tp_rank).to(ctx.device))  # (out, in/tp)
        self.bias = nn.Parameter(b.to(ctx.device)) if bias else None  # (out,), replicated
        if sequence_parallel:
            mark_sequence_parallel(self.bias)

    @classmethod
    def from_linear(cls, ctx, linear: nn.Linear, group: Any = None, **kw: Any) -> RowParallelLinear:
        """This rank's shard of a full `nn.Linear` (copied)."""
        layer = cls(ctx, linear.in_features, linear.out_features, linear.bias is not None, group, **kw)
        _copy_param(layer.weight, row_shard(linear.weight.detach(), layer.tp, layer.tp_rank), linear.weight)
        if linear.bias is not None:
            _copy_param(layer.bias, linear.bias.detach(), linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, grp, impl = self.ctx, self.group, self.impl
        if not self.input_is_parallel:
            x = scatter_to_tp_region(ctx, x, grp, impl)  # (B, T, in) -> (B, T, in/tp)
        y = F.linear(x, self.weight)  # (B, T, out): a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(ctx, y, grp, impl)  # (B, T/tp, out)
        else:
            y = reduce_from_tp_region(ctx, y, grp, impl)  # g: (B, T, out), the full sum
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.tp}, out={self.out_features}, sp={self.sequence_parallel}"


def dropout(x: torch.Tensor, p: float, training: bool, gen: torch.Generator) -> torch.Tensor:
    """Dropout drawing its mask from `gen`: ranks that must agree (a replicated region) share a seed."""
    if p == 0.0 or not training:
        return x
    keep = torch.rand(x.shape, generator=gen, device=x.device) >= p  # same shape, same draw
    return x * keep / (1.0 - p)


def dropout_generator(ctx, p: float, per_rank: bool, tp_rank: int) -> torch.Generator | None:
    """Replicated regions draw the same mask on every TP rank; split regions each their own."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    if p == 0.0:
        return None
    return torch.Generator(device=ctx.device).manual_seed(
        ctx.seed + (7919 * (tp_rank + 1) if per_rank else 0)
    )


class ParallelMLP(nn.Module):
    """Megatron's MLP: fc by columns, GeLU local, proj by rows; one all-reduce each way.

    With `sequence_parallel` the input and output are this rank's tokens (B, T/tp, C)
    and the all-reduces become all-gather + reduce-scatter.
    """

    def __init__(
        self,
        ctx,
        d_model: int,
        hidden: int | None = None,
        group: Any = None,
        sequence_parallel: bool = False,
        regather: bool = False,
        dropout: float = 0.0,
        impl: str = "ring",
        seed: int | None = None,
    ):
        super().__init__()
        hidden = 4 * d_model if hidden is None else hidden
        seed = ctx.seed if seed is None else seed
        sp = dict(sequence_parallel=sequence_parallel, impl=impl, group=group)
        self.fc = ColumnParallelLinear(ctx, d_model, hidden, regather=regather, seed=seed, **sp)
        self.proj = RowParallelLinear(ctx, hidden, d_model, seed=seed + 1, **sp)
        self.p = dropout
        self.gen = dropout_generator(ctx, dropout, sequence_parallel, self.fc.tp_rank)

    @classmethod
    def from_mlp(cls, ctx, mlp: nn.Module, group: Any = None, **kw: Any) -> ParallelMLP:
        """Shard a `models.MLP` (fc, proj, dropout) for this rank."""
        kw.setdefault("dropout", getattr(mlp, "dropout", 0.0))
        layer = cls(ctx, mlp.fc.in_features, mlp.fc.out_features, group, **kw)
        sp = dict(sequence_parallel=layer.fc.sequence_parallel, impl=layer.fc.impl)
        layer.fc = ColumnParallelLinear.from_linear(ctx, mlp.fc, group, regather=layer.fc.regather, **sp)
        layer.proj = RowParallelLinear.from_linear(ctx, mlp.proj, group, **sp)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))  # (B, T, 4C/tp): this rank's hidden units, complete values
        return dropout(self.proj(h), self.p, self.training, self.gen)  # (B, T, C) or (B, T/tp, C)


class RowFirstMLP(nn.Module):
    """The other order: fc by rows, proj by columns. Correct, and it communicates much more:
    an all-reduce of the (B, T, 4C) hidden activation before GeLU and an all-gather of the
    output in forward; an all-reduce of the (B, T, 4C) gradient and an all-gather backward."""

    def __init__(self, ctx, d_model: int, hidden: int | None = None, group: Any = None, impl: str = "ring",
                 seed: int | None = None):  # fmt: skip
        super().__init__()
        hidden = 4 * d_model if hidden is None else hidden
        seed = ctx.seed if seed is None else seed
        self.fc = RowParallelLinear(
            ctx, d_model, hidden, group=group, input_is_parallel=False, impl=impl, seed=seed
        )
        self.proj = ColumnParallelLinear(ctx, hidden, d_model, group=group, gather_output=True, impl=impl,
                                         seed=seed + 1)  # fmt: skip

    @classmethod
    def from_mlp(cls, ctx, mlp: nn.Module, group: Any = None, impl: str = "ring") -> RowFirstMLP:
        layer = cls(ctx, mlp.fc.in_features, mlp.fc.out_features, group, impl)
        layer.fc = RowParallelLinear.from_linear(ctx, mlp.fc, group, input_is_parallel=False, impl=impl)
        layer.proj = ColumnParallelLinear.from_linear(ctx, mlp.proj, group, gather_output=True, impl=impl)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))  # (B, T, 4C) on every rank: summed before the GeLU, the extra all-reduce
        return self.proj(h)  # (B, T, C), all-gathered from (B, T, C/tp)
