"""From-scratch binomial-tree collectives on send/recv: broadcast, reduce, all-reduce.

Binomial trees as in MPICH's broadcast/reduce (Thakur, Rabenseifner & Gropp 2005):
ceil(log2 p) rounds, each moving the WHOLE tensor, so they win on latency-bound
small messages and lose to the ring on bandwidth-bound big ones.
Invariant: every message goes through comms' traced exchange (`TracedOp`), so the bytes
each rank counts are the bytes its messages carried (comms/cost.py has the formulas).
Import them from `parallel_lab.comms`, which re-exports this module.
"""

from __future__ import annotations

import torch

from parallel_lab.comms.core import TracedOp, _check_dtype, _check_op, _check_rank, _flat, check_same_shape
from parallel_lab.comms.cost import _binomial_edges


def _tree_broadcast(o: TracedOp, flat: torch.Tensor, root: int) -> None:
    """Round k: the 2^k ranks that have the data send it to rank v + 2^k (relative to root)."""
    v = (o.me - root) % o.p
    for parent, child in _binomial_edges(o.p):
        if v == child:
            o.xchg(None, None, flat, (parent + root) % o.p, "broadcast")
        elif v == parent:
            o.xchg(flat, (child + root) % o.p, None, None, "broadcast")


def _tree_reduce(o: TracedOp, flat: torch.Tensor, root: int, op: str) -> torch.Tensor:
    """The broadcast tree walked backwards: each rank adds its children's partial sums, then
    sends its own up. Returns the partial sum this rank ends with (the total on the root)."""
    v = (o.me - root) % o.p
    acc, buf = flat, None
    for parent, child in reversed(_binomial_edges(o.p)):
        if v == parent:
            if buf is None:  # first child: keep the caller's tensor intact off the root
                buf = o.buffer(flat, flat.numel())
                acc = acc if v == 0 else acc.clone()
            o.xchg(None, None, buf, (child + root) % o.p, "reduce")
            o.combine(acc, buf, op, out=acc)
        elif v == child:
            o.xchg(acc, (parent + root) % o.p, None, None, "reduce")
    return acc


def tree_broadcast(
    ctx, tensor: torch.Tensor, src: int = 0, group=None, trace_steps: bool = False
) -> torch.Tensor:
    """Binomial-tree broadcast of `src`'s tensor into `tensor` on every rank (in place; returned).

    ceil(log2 p) rounds; every non-root rank receives the whole tensor once. Any dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    with TracedOp(ctx, "tree_broadcast", tensor, group, trace_steps) as o:
        _check_rank("src", src, o.p)
        check_same_shape(ctx, tensor, "tree_broadcast", o.group, root=src)
        flat = _flat(tensor)
        _tree_broadcast(o, flat, src)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


def tree_reduce(
    ctx, tensor: torch.Tensor, dst: int = 0, group=None, op: str = "sum", trace_steps: bool = False
) -> torch.Tensor | None:
    """Binomial-tree reduce to `dst`: there `tensor` is overwritten with the result and
    returned; other ranks return None and keep their tensor unchanged."""
    _check_dtype(tensor)
    _check_op(op)
    with TracedOp(ctx, "tree_reduce", tensor, group, trace_steps) as o:
        _check_rank("dst", dst, o.p)
        check_same_shape(ctx, tensor, "tree_reduce", o.group, op=op, root=dst)
        flat = _flat(tensor)
        acc = _tree_reduce(o, flat, dst, op)
        if o.me != dst:
            return None
        if op == "avg":
            acc.div_(o.p)
        if not tensor.is_contiguous():
            tensor.copy_(acc.view_as(tensor))
    return tensor


def tree_all_reduce(
    ctx, tensor: torch.Tensor, group=None, op: str = "sum", trace_steps: bool = False
) -> torch.Tensor:
    """Tree reduce to rank 0, then tree broadcast: 2 ceil(log2 p) steps of the WHOLE tensor.

    Fewer steps than the ring (latency-bound small messages win), more bytes
    (bandwidth-bound big ones lose). In place; returns `tensor`.
    """
    _check_dtype(tensor)
    _check_op(op)
    with TracedOp(ctx, "tree_all_reduce", tensor, group, trace_steps) as o:
        check_same_shape(ctx, tensor, "tree_all_reduce", o.group, op=op)
        flat = _flat(tensor)
        _tree_reduce(o, flat, 0, op)  # on rank 0 the sum lands in flat itself
        if o.me == 0 and op == "avg":
            flat.div_(o.p)
        _tree_broadcast(o, flat, 0)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


__all__ = ["tree_all_reduce", "tree_broadcast", "tree_reduce"]
