"""From-scratch collectives on send/recv: ring, pipelined ring, naive, all-to-all.

Ring: Patarasuk & Yuan (2009), the bandwidth-optimal all-reduce NCCL runs as its
ring. The binomial trees are in comms/tree.py.
Invariant: every message goes through comms' traced exchange (`TracedOp`), so the bytes
each rank counts are the bytes its messages carried (comms/cost.py has the formulas).
Import them from `parallel_lab.comms`, which re-exports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallel_lab.comms.core import (
    _MAX_SEGMENTS,
    TracedOp,
    _check_dtype,
    _check_op,
    _chunks,
    _combine,
    _flat,
    check_same_shape,
    independent_messages,
)


# ----------------------------------------------------------------------------- from scratch: ring
def _ring_reduce_scatter(o: TracedOp, chunks: list[torch.Tensor], op: str, inplace: bool) -> torch.Tensor:
    """p-1 steps; at step s rank r sends its partial sum of chunk r-s-1 to the right and
    adds what arrives from the left into chunk r-s-2. Ends with chunk r fully reduced."""
    p, me = o.p, o.me
    right, left = (me + 1) % p, (me - 1) % p
    width = max(c.numel() for c in chunks)
    # Receive buffers, reused every step. Out of place the partial sum is written over what
    # arrived, so two buffers alternate: one is being sent while the other receives.
    if inplace:  # one buffer, kept between calls (fresh pages cost a page fault each)
        bufs = [o.buffer(chunks[0], width, slot=0)]  # (max chunk,)
    else:  # the result lives in one of these: fresh ones
        bufs = [chunks[0].new_empty(width) for _ in range(2)]  # (max chunk,) x2
    acc = chunks[(me - 1) % p]  # our own contribution to the chunk that ends on the left
    for s in range(p - 1):
        k = (me - s - 2) % p  # the chunk arriving now
        got = bufs[s % len(bufs)][: chunks[k].numel()]
        o.xchg(acc, right, got, left, "reduce-scatter", tag=o.steps)  # every rank is at the same step
        acc = o.combine(chunks[k], got, op, out=chunks[k] if inplace else got)
    return acc


def _ring_all_gather(o: TracedOp, chunks: list[torch.Tensor]) -> None:
    """p-1 steps; at step s rank r forwards chunk r-s to the right and receives chunk r-s-1 in place."""
    p, me = o.p, o.me
    for s in range(p - 1):
        o.xchg(chunks[(me - s) % p], (me + 1) % p, chunks[(me - s - 1) % p], (me - 1) % p, "all-gather",
               tag=o.steps)  # fmt: skip


def ring_reduce_scatter(
    ctx, tensor: torch.Tensor, group=None, op: str = "sum", trace_steps: bool = False
) -> torch.Tensor:
    """Reduce `tensor` across ranks and return this rank's chunk of the result.

    The tensor is flattened and cut into p divmod chunks (module docstring); rank r
    gets chunk r as a new 1-D tensor of c_r elements. `tensor` is left unchanged.
    For a 1-D tensor whose numel p divides this equals `dist.reduce_scatter_tensor`.
    """
    _check_dtype(tensor)
    _check_op(op)
    with TracedOp(ctx, "ring_reduce_scatter", tensor, group, trace_steps) as o:
        check_same_shape(ctx, tensor, "ring_reduce_scatter", o.group, op=op)
        chunks = _chunks(_flat(tensor), o.p)
        out = chunks[o.me].clone() if o.p == 1 else _ring_reduce_scatter(o, chunks, op, inplace=False)
        if op == "avg":
            out.div_(o.p)
    return out


def ring_all_gather(ctx, tensor: torch.Tensor, group=None, trace_steps: bool = False) -> torch.Tensor:
    """Gather every rank's `tensor` (same shape everywhere); returns shape (p, *tensor.shape).

    `out.view(-1)` is the concatenation in rank order, i.e. `dist.all_gather_into_tensor`.
    Any dtype: nothing is reduced.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    with TracedOp(ctx, "ring_all_gather", tensor, group, trace_steps) as o:
        check_same_shape(ctx, tensor, "ring_all_gather", o.group)
        out = tensor.new_empty((o.p, *tensor.shape))  # (p, *shape)
        out[o.me].copy_(tensor)
        _ring_all_gather(o, list(out.view(o.p, tensor.numel())))
    return out


def ring_all_reduce(
    ctx, tensor: torch.Tensor, group=None, op: str = "sum", trace_steps: bool = False
) -> torch.Tensor:
    """All-reduce `tensor` in place (and return it) as ring reduce-scatter + ring all-gather.

    2(p-1) steps, each moving one chunk; every rank sends 2(p-1)/p of the tensor.
    """
    _check_dtype(tensor)
    _check_op(op)
    with TracedOp(ctx, "ring_all_reduce", tensor, group, trace_steps) as o:
        check_same_shape(ctx, tensor, "ring_all_reduce", o.group, op=op)
        flat = _flat(tensor)  # (n,)
        chunks = _chunks(flat, o.p)
        if o.p > 1:
            _ring_reduce_scatter(o, chunks, op, inplace=True)
        if op == "avg":
            chunks[o.me].div_(o.p)  # divide our chunk only: p times less work than the whole
        _ring_all_gather(o, chunks)
        if not tensor.is_contiguous():  # flat was a copy
            tensor.copy_(flat.view_as(tensor))
    return tensor


# ----------------------------------------------------------------------------- ring, pipelined
def ring_all_reduce_pipelined(
    ctx, tensor: torch.Tensor, group=None, op: str = "sum", segment_bytes: int | None = None
) -> torch.Tensor:
    """`ring_all_reduce` with every chunk cut into segments that flow independently.

    Same messages, same bytes, same result as the simple ring; what changes is *when*:
    a segment is forwarded to the right as soon as it is reduced, while the next ones
    are still on the wire, so sending, receiving and adding overlap instead of taking
    turns (this is what gloo's and NCCL's rings do). Receives for a step are posted one
    step ahead into one of two alternating buffers. `segment_bytes` (default: a quarter
    of a chunk, at least 1 MiB) trades overlap against the fixed cost of each message.
    """
    _check_dtype(tensor)
    _check_op(op)
    if segment_bytes is not None and (not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes must be a positive int or None, got {segment_bytes!r}")
    with TracedOp(ctx, "ring_all_reduce", tensor, group) as o:
        check_same_shape(ctx, tensor, "ring_all_reduce", o.group, op=op)
        flat = _flat(tensor)  # (n,)
        chunks = _chunks(flat, o.p)
        if o.p > 1:
            if segment_bytes is None:  # four segments a chunk: enough overlap, few messages
                segment_bytes = max(_MIN_SEGMENT, -(-chunks[0].numel() * flat.element_size() // 4))
            _pipelined_ring(o, chunks, op, max(1, segment_bytes // flat.element_size()))
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


_MIN_SEGMENT = 1 << 20  # bytes: below this a message's fixed cost outweighs the overlap it buys


def _pipelined_ring(o: TracedOp, chunks: list[torch.Tensor], op: str, seg: int) -> None:
    """Steps 0..p-2 reduce-scatter, p-1..2p-3 all-gather; segment j of step s+1 leaves as soon
    as segment j of step s is reduced (or, in the all-gather, has arrived).

    Each segment's send to the right and its receive from the left are posted together, as one
    batch (`TracedOp.post`): NCCL runs each batch as one kernel on its stream, in order, so a
    receive posted on its own would block the send queued behind it on every rank at once.
    Where messages run on their own (gloo) every all-gather receive is posted at the start
    instead, in place, each message with its own tag: a gloo sender waits until its receiver
    has posted, and the data of a chunk can arrive only once the chunk is fully reduced, after
    our own last send of it."""
    p, me = o.p, o.me
    right, left = (me + 1) % p, (me - 1) % p
    width = max(c.numel() for c in chunks)
    seg = max(seg, -(-width // _MAX_SEGMENTS))  # each message costs ~50 us of Python and gloo
    bufs = [o.buffer(chunks[0], width, slot=i) for i in range(2)]  # (max chunk,) x2, alternating by step
    last = 2 * (p - 1)

    def landing(s: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where step s's segments arrive, and the chunk segments they end up in."""
        k = (me - s - 2) % p  # the chunk arriving at step s, in both phases
        targets = list(chunks[k].split(seg))
        # reduce-scatter: land in a buffer and add into chunk k; all-gather: land in place
        land = list(bufs[s % 2][: chunks[k].numel()].split(seg)) if s < p - 1 else targets
        return land, targets

    pre = independent_messages(o.group)
    early: dict[tuple[int, int], list] = {}  # (all-gather step, segment) -> its receive, posted now
    if pre:
        for s in range(p - 1, last):
            for j, t in enumerate(landing(s)[0]):
                early[s, j] = o.post(None, right, t, left, tag=s * _MAX_SEGMENTS + j)

    def post(s: int, j: int, out: list[torch.Tensor], land: list[torch.Tensor]) -> list:
        """Step s, segment j: send out[j] right and receive land[j] from the left, one batch."""
        send = out[j] if j < len(out) else None
        tag = s * _MAX_SEGMENTS + j  # a tag per message of the call (`TracedOp.post`)
        if pre and s >= p - 1:
            return o.post(send, right, None, left, tag=tag) + early.pop((s, j), [])
        recv = land[j] if j < len(land) else None
        return o.post(send, right, recv, left, tag=tag)

    out = list(chunks[(me - 1) % p].split(seg))  # step 0 sends our own chunk r-1
    land, targets = landing(0)
    pending = [post(0, j, out, land) for j in range(max(len(out), len(land)))]
    for s in range(last):
        nxt = landing(s + 1) if s + 1 < last else ([], [])
        ahead = []
        for j in range(len(pending)):
            for w in pending[j]:
                w.wait()
            if j < len(targets) and s < p - 1:
                _combine(targets[j], land[j], op, out=targets[j])
                if s == p - 2 and op == "avg":
                    targets[j].div_(p)  # fully reduced: our chunk, divided once before it travels
            if s + 1 < last and j < max(len(targets), len(nxt[0])):
                ahead.append(post(s + 1, j, targets, nxt[0]))
        # segments of step s+1 beyond those of step s (uneven chunks differ by one element)
        for j in range(len(ahead), max(len(targets), len(nxt[0])) if s + 1 < last else 0):
            ahead.append(post(s + 1, j, targets, nxt[0]))
        o.steps += 1
        pending, (land, targets) = ahead, nxt


def naive_all_reduce(
    ctx, tensor: torch.Tensor, group=None, op: str = "sum", trace_steps: bool = False
) -> torch.Tensor:
    """Reduce to rank 0, then broadcast from it, both flat (rank 0 talks to everyone in turn).

    Rank 0 receives and sends (p-1) whole tensors: its link is the bottleneck, and the
    time grows with p. The ring spreads the same work evenly. In place; returns `tensor`.
    """
    _check_dtype(tensor)
    _check_op(op)
    with TracedOp(ctx, "naive_all_reduce", tensor, group, trace_steps) as o:
        check_same_shape(ctx, tensor, "naive_all_reduce", o.group, op=op)
        flat = _flat(tensor)
        if o.me == 0:
            buf = o.buffer(flat, flat.numel())
            for r in range(1, o.p):  # reduce: one message from each rank
                o.xchg(None, None, buf, r, "reduce")
                o.combine(flat, buf, op, out=flat)
            if op == "avg":
                flat.div_(o.p)
            for r in range(1, o.p):  # broadcast: one message to each rank
                o.xchg(flat, r, None, None, "broadcast")
        else:
            o.xchg(flat, 0, None, None, "reduce")
            o.xchg(None, None, flat, 0, "broadcast")
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


def all_to_all(
    ctx, tensors: Sequence[torch.Tensor], group=None, trace_steps: bool = False
) -> list[torch.Tensor]:
    """Rank r sends `tensors[j]` to rank j and returns `out` with `out[j]` = rank j's `tensors[r]`.

    `tensors` holds p tensors of one shape and dtype, the same on every rank (any
    dtype, any numel). Pairwise exchange: at step s = 1..p-1 rank r sends to r+s while
    receiving from r-s, so every pair meets once and nobody waits on a busy peer.
    """
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("tensors must be a list of torch.Tensor, one per rank")
    with TracedOp(ctx, "all_to_all", tensors[0] if len(tensors) else None, group, trace_steps) as o:
        if len(tensors) != o.p:
            raise ValueError(f"tensors must hold one tensor per rank: got {len(tensors)}, group size {o.p}")
        first = tensors[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
            raise ValueError("tensors must all have the same shape and dtype")
        o.args["numel"] = first.numel() * o.p
        check_same_shape(ctx, first, "all_to_all", o.group)
        out = [torch.empty(first.shape, dtype=first.dtype, device=first.device) for _ in range(o.p)]
        out[o.me].copy_(tensors[o.me])
        for s in range(1, o.p):
            dst, src = (o.me + s) % o.p, (o.me - s) % o.p
            o.xchg(tensors[dst].contiguous(), dst, out[src], src, "exchange")
    return out


__all__ = [
    "all_to_all",
    "naive_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_all_reduce_pipelined",
    "ring_reduce_scatter",
]
