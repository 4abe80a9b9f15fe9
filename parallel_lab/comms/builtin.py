"""Traced wrappers of the torch.distributed collectives (the built-ins we compare with).

Also the two ways a collective runs while compute goes on (used by BucketedDDP):
`AsyncAllReduce`, a built-in all-reduce in flight drawn from issue to completion, and
`CommThread`, one background thread that runs our own ring collectives in order.

Invariant: each call records one "comm" span and the NOMINAL bytes of the textbook
algorithm (the backend does not report what it sends; gloo's reduce_scatter, for
one, is an all-reduce inside and moves about twice that).
Import them from `parallel_lab.comms`, which re-exports this module.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.comms.core import (
    _DIST_OPS,
    Handle,
    TracedOp,
    _check_op,
    _check_rank,
    _chunks,
    _flat,
    _global,
    _group,
    check_device,
    check_same_shape,
)
from parallel_lab.comms.cost import ring_bytes_per_rank, tree_bytes_per_rank
from parallel_lab.runtime import device as dev
from parallel_lab.runtime.memory import seen_by, thread_trackers


# ----------------------------------------------------------------------------- traced built-ins
def _dist_op(op):
    if isinstance(op, dist.ReduceOp.RedOpType if hasattr(dist.ReduceOp, "RedOpType") else dist.ReduceOp):
        return op
    _check_op(op)
    return _DIST_OPS[op]


def _ring_peers(o: TracedOp) -> list[int]:
    return [] if o.p == 1 else sorted({(o.me - 1) % o.p, (o.me + 1) % o.p})


def dist_all_reduce(ctx, tensor: torch.Tensor, op="sum", group=None, async_op: bool = False):
    """`dist.all_reduce`, traced; books the ring's nominal bytes. In place; returns `tensor`,
    or with `async_op=True` a `Handle` whose `.wait()` returns it (the span covers issue -> wait)."""
    g = _group(ctx, group)
    o = TracedOp(ctx, "all_reduce", tensor, g)
    o.nominal(
        ring_bytes_per_rank(tensor.numel(), o.p, tensor.element_size(), "all_reduce")[o.me], _ring_peers(o)
    )
    if async_op:
        ctx.recorder.enter_comm("all_reduce")  # a peer that never comes is waited for in the check
        check_same_shape(ctx, tensor, "all_reduce", g, op=op)
        ctx.recorder.leave_comm("all_reduce")
        work = dist.all_reduce(tensor, op=_dist_op(op), group=g, async_op=True)
        args = {**o.args, "peers": sorted(o.peers), "steps": 2 * (o.p - 1)}
        return Handle(ctx, "all_reduce", [work], args, o.sent, o.recv, tensor)
    with o:
        check_same_shape(ctx, tensor, "all_reduce", g, op=op)
        dist.all_reduce(tensor, op=_dist_op(op), group=g)
    return tensor


def dist_broadcast(ctx, tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """`dist.broadcast` from group rank `src`, traced (binomial-tree nominal bytes). In place."""
    with TracedOp(ctx, "broadcast", tensor, group) as o:
        _check_rank("src", src, o.p)
        check_same_shape(ctx, tensor, "broadcast", o.group, root=src)
        o.nominal(
            tree_bytes_per_rank(tensor.numel(), o.p, tensor.element_size(), "broadcast", src)[o.me],
            [src] if o.me != src else [],
        )
        dist.broadcast(tensor, src=_global(o.group, src), group=o.group)
    return tensor


def dist_reduce(ctx, tensor: torch.Tensor, dst: int = 0, op="sum", group=None) -> torch.Tensor:
    """`dist.reduce` to group rank `dst`, traced (binomial-tree nominal bytes); result in `tensor` on dst."""
    with TracedOp(ctx, "reduce", tensor, group) as o:
        _check_rank("dst", dst, o.p)
        check_same_shape(ctx, tensor, "reduce", o.group, op=op, root=dst)
        o.nominal(
            tree_bytes_per_rank(tensor.numel(), o.p, tensor.element_size(), "reduce", dst)[o.me],
            [dst] if o.me != dst else [],
        )
        dist.reduce(tensor, dst=_global(o.group, dst), op=_dist_op(op), group=o.group)
    return tensor


def dist_all_gather(ctx, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """`dist.all_gather`, traced (ring nominal bytes); returns shape (p, *tensor.shape)."""
    with TracedOp(ctx, "all_gather", tensor, group) as o:
        check_same_shape(ctx, tensor, "all_gather", o.group)
        out = tensor.new_empty((o.p, *tensor.shape))  # (p, *shape)
        n = tensor.numel() * o.p
        o.nominal(ring_bytes_per_rank(n, o.p, tensor.element_size(), "all_gather")[o.me], _ring_peers(o))
        dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=o.group)
    return out


def dist_gather(ctx, tensor: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor | None:
    """`dist.gather` to group rank `dst`, traced (flat: everyone sends to dst).
    Returns shape (p, *tensor.shape) on `dst`, None elsewhere."""
    with TracedOp(ctx, "gather", tensor, group) as o:
        _check_rank("dst", dst, o.p)
        check_same_shape(ctx, tensor, "gather", o.group, root=dst)
        nb = tensor.numel() * tensor.element_size()
        root = o.me == dst
        out = tensor.new_empty((o.p, *tensor.shape)) if root else None
        o.nominal(
            (0, (o.p - 1) * nb) if root else (nb, 0), [r for r in range(o.p) if r != o.me] if root else [dst]
        )
        dist.gather(
            tensor.contiguous(),
            list(out.unbind(0)) if root else None,
            dst=_global(o.group, dst),
            group=o.group,
        )
    return out


def dist_scatter(
    ctx, tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None = None, src: int = 0, group=None
) -> torch.Tensor:
    """`dist.scatter` from group rank `src` into `tensor`, traced (flat). `scatter_list`
    (p tensors shaped like `tensor`) is needed on `src` only. Returns `tensor`."""
    with TracedOp(ctx, "scatter", tensor, group) as o:
        _check_rank("src", src, o.p)
        check_same_shape(ctx, tensor, "scatter", o.group, root=src)
        root = o.me == src
        if root and (scatter_list is None or len(scatter_list) != o.p):
            raise ValueError(f"scatter_list must hold {o.p} tensors on the src rank")
        nb = tensor.numel() * tensor.element_size()
        o.nominal(
            ((o.p - 1) * nb, 0) if root else (0, nb), [r for r in range(o.p) if r != o.me] if root else [src]
        )
        dist.scatter(
            tensor,
            [t.contiguous() for t in scatter_list] if root else None,
            src=_global(o.group, src),
            group=o.group,
        )
    return tensor


def dist_reduce_scatter(ctx, tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """`dist.reduce_scatter` on the divmod chunks of `tensor` flattened (like `ring_reduce_scatter`),
    traced with the ring's nominal bytes; gloo really moves about twice that (an all-reduce inside)."""
    with TracedOp(ctx, "reduce_scatter", tensor, group) as o:
        check_same_shape(ctx, tensor, "reduce_scatter", o.group, op=op)
        chunks = _chunks(_flat(tensor), o.p)
        out = torch.empty_like(chunks[o.me])
        o.nominal(
            ring_bytes_per_rank(tensor.numel(), o.p, tensor.element_size(), "reduce_scatter")[o.me],
            _ring_peers(o),
        )
        dist.reduce_scatter(out, chunks, op=_dist_op(op), group=o.group)
    return out


def dist_all_to_all(ctx, tensors: Sequence[torch.Tensor], group=None) -> list[torch.Tensor]:
    """`dist.all_to_all`, traced (pairwise nominal bytes); same contract as `all_to_all`."""
    for i, t in enumerate(tensors):
        check_device(ctx, t, f"tensors[{i}]")
    with TracedOp(ctx, "all_to_all", None, group) as o:
        if len(tensors) != o.p:
            raise ValueError(f"tensors must hold one tensor per rank: got {len(tensors)}, group size {o.p}")
        check_same_shape(ctx, tensors[0], "all_to_all", o.group)
        nb = tensors[0].numel() * tensors[0].element_size()
        o.args.update(numel=tensors[0].numel() * o.p, dtype=str(tensors[0].dtype).replace("torch.", ""))
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        o.nominal(((o.p - 1) * nb, (o.p - 1) * nb), [r for r in range(o.p) if r != o.me])
        dist.all_to_all(out, [t.contiguous() for t in tensors], group=o.group)
    return out


def dist_barrier(ctx, group=None) -> None:
    """`dist.barrier`, traced (no payload)."""
    with TracedOp(ctx, "barrier", None, group):
        dist.barrier(group=_group(ctx, group))


# ----------------------------------------------------------------------------- asynchronous: a built-in in flight, our own on a thread
class AsyncAllReduce:
    """`dist.all_reduce(async_op=True)` drawn on the timeline from issue to *completion*.

    gloo runs the reduction on its own threads, outside the GIL, so backward keeps
    computing meanwhile. The completion time comes from the work's future (a
    callback on gloo's thread) on a CPU, and from a CUDA event on a side stream that
    waits for the reduction alone on a GPU; `wait()` records the span and books the
    ring's nominal bytes, like `dist_all_reduce`.
    """

    def __init__(self, ctx, tensor: torch.Tensor, group=None, name: str = "all_reduce", **args: Any):
        self.ctx, self.name, self.rec = ctx, name, ctx.recorder
        p, me = dist.get_world_size(group), dist.get_rank(group)
        self.sent, self.recv = ring_bytes_per_rank(tensor.numel(), p, tensor.element_size(), "all_reduce")[me]
        self.args = {"op": "all_reduce", "numel": tensor.numel(), "dtype": str(tensor.dtype)[6:], **args}
        self.start, self.done_at, self.tensor = self.rec.mark(), None, tensor
        self.rec.enter_comm(name)
        self.work = dist.all_reduce(tensor, group=group, async_op=True)
        self.future = self.work.get_future()
        self.future.add_done_callback(self._done)
        self.end_mark = None
        if self.rec.clock is not None:
            # GPU: an event on an idle side stream made to wait for the reduction fires the moment it
            # completes. An event on the compute stream at wait() would also wait for all compute
            # queued before it, and stretch the span over the backward it should overlap.
            with dev.on_stream(dev.side_stream(ctx.device)):
                self.work.wait()  # only orders the side stream after the reduction
                self.end_mark = self.rec.mark()

    def _done(self, _fut: Any) -> None:
        # gloo runs this on its own thread the moment the reduction finished. NCCL's future completes
        # when the op is queued, so on a GPU the span ends at the side stream's event (`end_mark`).
        if self.rec.clock is None:
            self.done_at = self.rec.now()

    def wait(self) -> torch.Tensor:
        """Block until the reduction is done; returns the (reduced, in place) tensor."""
        if self.work is not None:
            self.work.wait()
            self.record(self.done_at)
        return self.tensor

    def record(self, end: float | None = None) -> None:
        """Book the span (issue -> `end`, default now) and the bytes, once."""
        if self.work is None:
            return
        self.work = None
        if end is None:
            end = self.end_mark if self.end_mark is not None else self.rec.mark()
        self.rec.add_event(self.name, "comm", self.start, end, **self.args, bytes_sent=self.sent,
                           bytes_recv=self.recv)  # fmt: skip
        self.rec.count_bytes("all_reduce", self.sent, self.recv)
        self.rec.leave_comm(self.name)


class CommThread:
    """One background thread that runs our from-scratch ring all-reduces in order.

    On a CPU the thread is the "comm stream" (an emulation: both share the cores). On a GPU the
    thread also runs its kernels on a CUDA stream of its own, bound to the rank's device: a job
    starts after what the submitting stream had queued (the gradients it reduces), and `wait()`
    makes the caller's stream wait for the job's kernels."""

    def __init__(self, device: Any = None) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._threads = torch.get_num_threads()
        threading.Thread(target=self._run, daemon=True, name="parallel_lab-comm").start()

    def _run(self) -> None:
        # OpenMP's thread count is per thread: a new thread would start its own pool of one thread per
        # core for any op that computes (a hook's matmuls), which in a forked rank costs far more than the
        # op. The rank's setting carries over.
        torch.set_num_threads(self._threads)
        dev.bind_thread(self.device)
        stream = dev.side_stream(self.device)
        while True:
            fn, box, done, ready, trackers = self.jobs.get()
            try:
                with seen_by(trackers), dev.on_stream(stream):
                    dev.wait_for(ready)
                    box.append(fn())
                    box.append(dev.stream_point(self.device))
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at wait()
                box[:] = [e, None]
            done.set()

    def submit(self, fn: Any) -> _ThreadHandle:
        """Queue `fn()` behind the jobs already queued; `.wait()` on the result returns its value."""
        h = _ThreadHandle()
        # A memory tracker's dispatch mode (how it sees allocations on a GPU) is per thread: the job
        # runs under the submitter's, so the comm thread's temporaries (a hook's casts, top-k clones,
        # PowerSGD's P and Q) count on a GPU as the allocator hook counts them on a CPU.
        trackers = thread_trackers()
        self.jobs.put((fn, h.box, h.done, dev.stream_point(self.device), trackers))
        return h


@dataclass
class _ThreadHandle:
    box: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> Any:
        self.done.wait()
        if isinstance(self.box[0], BaseException):
            raise self.box[0]
        dev.wait_for(self.box[1])  # GPU: the caller's stream waits for the job's kernels
        return self.box[0]


__all__ = [
    "AsyncAllReduce",
    "CommThread",
    "dist_all_gather",
    "dist_all_reduce",
    "dist_all_to_all",
    "dist_barrier",
    "dist_broadcast",
    "dist_gather",
    "dist_reduce",
    "dist_reduce_scatter",
    "dist_scatter",
]
