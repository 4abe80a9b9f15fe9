"""Sequence parallelism: the parts tensor parallelism leaves replicated, split along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4.2.2. Under plain TP, LayerNorm, dropout and the residual stream are
computed in full on every TP rank: their activations (about 10·s·b·h bytes of a
layer's 34·s·b·h in fp16) do not shrink with TP. These ops are independent per token,
so each rank can run them on its own s/tp tokens instead. Entering the TP region then
needs the whole sequence (**all-gather** along the sequence, where TP had f's
identity) and leaving it sums partial results into one shard per rank
(**reduce-scatter**, where TP had g's all-reduce). Backward swaps them. A ring
all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes are equal.

Two consequences handled here:
- parameters used on a sequence shard (LayerNorm weights, the row-parallel bias) get
  only their shard's share of the gradient: `sync_sequence_parallel_grads` sums them
  over the TP group after backward (Megatron's `allreduce_sequence_parallel_grads`);
- the column-parallel linear after an all-gather would save the *gathered* input for
  its weight gradient; `sequence_parallel_linear` saves only the shard and gathers it
  again in backward (Megatron does the same, overlapping that all-gather with the
  input-gradient reduce-scatter): one more all-gather for t times less memory.

Invariant: with the same weights, a sequence-parallel layer's shard of the output (and
of every gradient) equals that slice of the plain TP layer's, up to summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.tensor_parallel.operators import (
    all_gather,
    all_reduce,
    as_activation,
    check_impl,
    reduce_scatter,
    split,
)

SEQ_DIM = 1  # the lab's activations are (B, T, C)


class _ScatterToSequence(torch.autograd.Function):
    """Keep this rank's tokens forward; all-gather the gradient backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl, dim):
        fctx.run = (ctx, group, impl, dim)
        with as_activation(ctx):
            return split(ctx, x, dim, group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, impl, dim = fctx.run
        return all_gather(ctx, grad, dim, group, impl), None, None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the tokens forward. Backward: reduce-scatter when the consumer is
    tensor-parallel (each rank holds a partial gradient), else keep this rank's slice."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl, dim, grad_is_partial):
        fctx.run = (ctx, group, impl, dim, grad_is_partial)
        with as_activation(ctx):
            return all_gather(ctx, x, dim, group, impl)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, impl, dim, partial = fctx.run
        out = reduce_scatter(ctx, grad, dim, group, impl) if partial else split(ctx, grad, dim, group)
        return out, None, None, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sum the partial results and keep this rank's tokens forward; all-gather backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, impl, dim):
        fctx.run = (ctx, group, impl, dim)
        with as_activation(ctx):
            return reduce_scatter(ctx, x, dim, group, impl)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, impl, dim = fctx.run
        return all_gather(ctx, grad, dim, group, impl), None, None, None, None


def scatter_to_sequence_region(
    ctx, x: torch.Tensor, group: Any = None, impl: str = "ring", dim: int = SEQ_DIM
) -> torch.Tensor:
    """(B, T, C) replicated -> (B, T/tp, C) this rank's tokens (no communication forward)."""
    return _ScatterToSequence.apply(x, ctx, group, check_impl(impl), dim)


def gather_from_sequence_region(
    ctx,
    x: torch.Tensor,
    group: Any = None,
    impl: str = "ring",
    dim: int = SEQ_DIM,
    grad_is_partial: bool = True,
) -> torch.Tensor:
    """(B, T/tp, C) -> (B, T, C) on every rank (all-gather); replaces f in front of a TP region.

    `grad_is_partial=False` when what follows is replicated (e.g. the final LayerNorm and
    the head): every rank then already holds the whole gradient and keeps its slice.
    """
    return _GatherFromSequence.apply(x, ctx, group, check_impl(impl), dim, grad_is_partial)


def reduce_scatter_to_sequence_region(
    ctx, x: torch.Tensor, group: Any = None, impl: str = "ring", dim: int = SEQ_DIM
) -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T/tp, C) of the total (reduce-scatter); replaces g."""
    return _ReduceScatterToSequence.apply(x, ctx, group, check_impl(impl), dim)


class _SequenceParallelLinear(torch.autograd.Function):
    """all-gather + column-parallel linear that saves only this rank's tokens (Korthikanti §4.2.2)."""

    @staticmethod
    def forward(fctx, x_shard, weight, bias, ctx, group, impl, dim):
        with as_activation(ctx):
            x = all_gather(ctx, x_shard, dim, group, impl)  # (B, T, in)
            out = F.linear(x, weight, bias)  # (B, T, out/tp)
        fctx.save_for_backward(x_shard, weight)  # the shard, not x: t times fewer bytes kept
        fctx.run = (ctx, group, impl, dim, bias is not None)
        return out

    @staticmethod
    def backward(fctx, grad):  # grad: (B, T, out/tp)
        x_shard, weight = fctx.saved_tensors
        ctx, group, impl, dim, has_bias = fctx.run
        x = all_gather(ctx, x_shard, dim, group, impl)  # (B, T, in): gathered again
        grad_x = reduce_scatter(ctx, grad @ weight, dim, group, impl)  # (B, T/tp, in), summed over ranks
        g2 = grad.reshape(-1, grad.shape[-1])  # (B*T, out/tp)
        grad_w = g2.t() @ x.reshape(-1, x.shape[-1])  # (out/tp, in)
        grad_b = g2.sum(0) if has_bias else None  # (out/tp,)
        return grad_x, grad_w, grad_b, None, None, None, None


def sequence_parallel_linear(
    ctx,
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Any = None,
    impl: str = "ring",
    dim: int = SEQ_DIM,
) -> torch.Tensor:
    """F.linear(all_gather(x_shard), weight, bias), keeping only `x_shard` for backward."""
    return _SequenceParallelLinear.apply(x_shard, weight, bias, ctx, group, check_impl(impl), dim)


def mark_sequence_parallel(*params: nn.Parameter) -> None:
    """Tag parameters used on sequence shards: their gradients need a sum over the TP group."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def sync_sequence_parallel_grads(ctx, module: nn.Module, group: Any = None, impl: str = "ring") -> int:
    """All-reduce (sum) the gradients of `module`'s sequence-parallel parameters over the TP group.

    Call after backward, before the optimizer step. The gradients travel as one flat
    buffer (one collective, not one per LayerNorm). Returns the number of elements reduced.
    """
    grads = [
        p.grad
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and p.requires_grad and p.grad is not None
    ]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])  # (n,)
    all_reduce(ctx, flat, group, check_impl(impl))
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return flat.numel()
