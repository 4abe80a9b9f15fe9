"""Tensor parallelism (Megatron-LM): the f and g operators and the matmul splits they come from.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", §3. Write a linear layer as Y = X A (A = `nn.Linear.weight`.T).

- Split A by **columns** (the output features; the *rows* of `nn.Linear.weight`): each
  rank computes its own slice of Y from the whole X. The slices are complete values:
  an **all-gather** joins them (or the next layer consumes them split).
- Split A by **rows** (the input features): X must be split the same way, and each rank
  computes a full-size *partial sum* of Y: an **all-reduce** adds them up.

Megatron chains the two so that a whole MLP (or attention) needs one all-reduce in
forward and one in backward, through two conjugate autograd operators:

    f: forward identity,    backward all-reduce   (enters the parallel region)
    g: forward all-reduce,  backward identity     (leaves it)

plus `gather_from_tp_region` / `scatter_to_tp_region` (all-gather vs split along the last
dim). Sequence-parallel twins live in `tensor_parallel/sequence_parallel.py`; the layers built from these
in `tensor_parallel/layers.py` (Column/RowParallelLinear, MLP) and `tensor_parallel/transformer.py` (attention,
block, GPT).

Invariant: every operator is exactly the identity on the *math* of the single-process
model: the values (forward) and gradients (backward) a rank holds are its slice of, or
equal to, the single-process ones. All communication goes through `parallel_lab.comms`,
so it is traced and its bytes are counted: `impl="ring"` (default) runs the from-scratch
ring collectives and counts the bytes their messages carried; `impl="builtin"` runs
torch.distributed's and books the ring's nominal bytes (the same numbers).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab import comms

IMPLS = ("ring", "builtin")


# ----------------------------------------------------------------------------- groups, checks
def tp_group(ctx, group: Any = None) -> Any:
    """The process group a TP layer works on: `group`, else `ctx.group`, else the world (None)."""
    return group if group is not None else getattr(ctx, "group", None)


def tp_size_rank(ctx, group: Any = None) -> tuple[int, int]:
    """(tensor-parallel size, this rank's index in the TP group)."""
    g = tp_group(ctx, group)
    return dist.get_world_size(g), dist.get_rank(g)


def check_divisible(name: str, value: int, tp: int, what: str = "the tensor-parallel size") -> int:
    """`value // tp`, or ValueError naming `name` when `tp` does not divide it (Megatron's rule too)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value % tp:
        raise ValueError(f"{name} ({value}) must be divisible by {what} ({tp})")
    return value // tp


def as_activation(ctx):
    """Inside an autograd Function's forward grad mode is off, so a memory tracker would file
    new tensors under "other": they are activations of the step, label them so."""
    mem = getattr(ctx, "memory", None)
    return mem.category("activation") if mem is not None else contextlib.nullcontext()


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


# ----------------------------------------------------------------------------- collectives along a dim
def all_reduce(ctx, t: torch.Tensor, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Sum of `t` over the TP group (in place on `t`; returned)."""
    if impl == "ring":
        return comms.ring_all_reduce(ctx, t, group=tp_group(ctx, group))
    return comms.dist_all_reduce(ctx, t, group=tp_group(ctx, group))


def all_gather(ctx, t: torch.Tensor, dim: int, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Every rank's `t` concatenated along `dim` in rank order (a new tensor)."""
    grp = tp_group(ctx, group)
    p = dist.get_world_size(grp)
    if p == 1:
        return t
    front = t.movedim(dim, 0).contiguous()  # (n, *rest): rank blocks become contiguous
    fn = comms.ring_all_gather if impl == "ring" else comms.dist_all_gather
    out = fn(ctx, front, group=grp)  # (p, n, *rest)
    return out.flatten(0, 1).movedim(0, dim).contiguous()  # (..., p*n, ...)


def reduce_scatter(ctx, t: torch.Tensor, dim: int, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Sum over the TP group, of which this rank keeps block `rank` along `dim` (p must divide it)."""
    grp = tp_group(ctx, group)
    p = dist.get_world_size(grp)
    if p == 1:
        return t.clone()
    n = t.shape[dim]
    check_divisible(f"dimension {dim} of the tensor", n, p)
    front = t.movedim(dim, 0).contiguous()  # (n, *rest)
    # p | n, so the divmod chunks of the flat tensor are exactly the n/p-row blocks
    fn = comms.ring_reduce_scatter if impl == "ring" else comms.dist_reduce_scatter
    mine = fn(ctx, front, group=grp)  # (n/p * prod(rest),)
    return mine.view(n // p, *front.shape[1:]).movedim(0, dim).contiguous()


def split(ctx, t: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's block of `t` along `dim` (no communication; p must divide the dim)."""
    p, r = tp_size_rank(ctx, group)
    if p == 1:
        return t
    check_divisible(f"dimension {dim} of the tensor", t.shape[dim], p)
    return t.chunk(p, dim)[r].contiguous()


# ----------------------------------------------------------------------------- f and g
class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl):
        fctx.run = (ctx, group, impl)
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, impl = fctx.run
        return all_reduce(ctx, grad.contiguous().clone(), group, impl), None, None, None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward (partial sums -> the full value); identity backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl):
        with as_activation(ctx):
            return all_reduce(ctx, x.contiguous().clone(), group, impl)

    @staticmethod
    def backward(fctx, grad):
        return grad, None, None, None


class _GatherFromTPRegion(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl):
        fctx.run = (ctx, group)
        with as_activation(ctx):
            return all_gather(ctx, x, -1, group, impl)

    @staticmethod
    def backward(fctx, grad):
        ctx, group = fctx.run
        return split(ctx, grad, -1, group), None, None, None


class _ScatterToTPRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl):
        fctx.run = (ctx, group, impl)
        with as_activation(ctx):
            return split(ctx, x, -1, group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, impl = fctx.run
        return all_gather(ctx, grad, -1, group, impl), None, None, None


def copy_to_tp_region(ctx, x: torch.Tensor, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Megatron's f: the replicated input enters a parallel region (identity; all-reduce in backward)."""
    return _CopyToTPRegion.apply(x, ctx, group, check_impl(impl))


def reduce_from_tp_region(ctx, x: torch.Tensor, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Megatron's g: partial sums leave a parallel region (all-reduce; identity in backward)."""
    return _ReduceFromTPRegion.apply(x, ctx, group, check_impl(impl))


def gather_from_tp_region(ctx, x: torch.Tensor, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """Column-split outputs (B, T, n/tp) -> the whole (B, T, n) on every rank (all-gather)."""
    return _GatherFromTPRegion.apply(x, ctx, group, check_impl(impl))


def scatter_to_tp_region(ctx, x: torch.Tensor, group: Any = None, impl: str = "ring") -> torch.Tensor:
    """A replicated (B, T, n) -> this rank's (B, T, n/tp) slice (no communication forward)."""
    return _ScatterToTPRegion.apply(x, ctx, group, check_impl(impl))


f = copy_to_tp_region  # the paper's names
g = reduce_from_tp_region


# ----------------------------------------------------------------------------- shards of a full weight
def column_shard(t: torch.Tensor, tp: int, rank: int, partitions: int = 1) -> torch.Tensor:
    """Rank `rank`'s output-feature rows of a full weight (out, in) or bias (out,).

    `partitions` > 1 treats dim 0 as that many stacked matrices split separately (a
    fused qkv projection: q, k and v each give this rank the same heads).
    """
    blocks = t.chunk(partitions, dim=0)  # partitions x (out/partitions, ...)
    return torch.cat([b.chunk(tp, dim=0)[rank] for b in blocks]).clone()


def row_shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s input-feature columns of a full weight (out, in): (out, in/tp)."""
    return weight.chunk(tp, dim=1)[rank].clone()


# ----------------------------------------------------------------------------- one matmul, split two ways
def split_matmul(
    ctx, weight: torch.Tensor, x: torch.Tensor, split_by: str, group: Any = None, impl: str = "ring"
) -> dict:
    """y = W x with W split across ranks two ways (a 3x2 · 2x1 example, split by rows or by columns).

    split_by="output": rank r holds rows of W (output features; a *column* split of
    A = W^T in Megatron's Y = XA) and the whole x; y_r = W_r x is a finished slice of y,
    and an **all-gather** assembles y. split_by="input": rank r holds columns of W (input
    features; a *row* split of A) and the matching rows of x; W[:, r] x[r] is a full-size
    partial sum, and an **all-reduce** adds them. Returns what this rank held and did.
    """
    if split_by not in ("output", "input"):
        raise ValueError(f"split_by must be 'output' or 'input', got {split_by!r}")
    check_impl(impl)
    p, r = tp_size_rank(ctx, group)
    sent0 = sum(c["sent"] for c in ctx.recorder.comm.values())
    if split_by == "output":
        check_divisible("weight rows (output features)", weight.shape[0], p)
        w_r = weight.chunk(p, dim=0)[r]  # (out/p, in)
        local = w_r @ x  # (out/p, k): complete entries of y
        y = all_gather(ctx, local, 0, group, impl)  # (out, k)
        op = "all-gather"
    else:
        check_divisible("weight columns (input features)", weight.shape[1], p)
        w_r = weight.chunk(p, dim=1)[r]  # (out, in/p)
        local = w_r @ x.chunk(p, dim=0)[r]  # (out, k): a partial sum of every entry
        y = all_reduce(ctx, local.clone(), group, impl)  # (out, k)
        op = "all-reduce"
    sent = sum(c["sent"] for c in ctx.recorder.comm.values()) - sent0
    return {"shard": w_r.clone(), "local": local, "y": y, "collective": op, "bytes_sent": sent}


__all__ = [
    "all_gather",
    "all_reduce",
    "column_shard",
    "copy_to_tp_region",
    "f",
    "g",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter",
    "row_shard",
    "scatter_to_tp_region",
    "split",
    "split_matmul",
]
