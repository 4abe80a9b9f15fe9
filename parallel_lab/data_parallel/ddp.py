"""Bucketed DDP: gradients all-reduced in buckets, launched from gradient hooks while backward still runs.

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB), §3.2: one all-reduce per parameter pays the per-message latency
hundreds of times, one all-reduce of everything after backward leaves the link
idle during backward. DDP does neither: parameters are grouped into buckets of
about `bucket_bytes` in *reverse* registration order (roughly the order backward
produces their gradients), and a bucket's all-reduce starts, asynchronously, the
moment the last of its gradients is accumulated; backward goes on computing the
earlier layers meanwhile. `no_sync()` skips the all-reduce on the non-final
micro-steps of gradient accumulation (the gradients just add up locally).

Each bucket owns one flat buffer; every parameter's `.grad` is a view into it (torch
DDP's `gradient_as_bucket_view`), so the all-reduce runs on the gradients in place
and there is no second copy of the gradients.

`hook=` (with `comm="ring"`) replaces a bucket's all-reduce by a communication hook, as torch DDP's
`register_comm_hook` does: lesson 18's compressed all-reduces (`data_parallel/compression.py`).

Invariants: after `finish_gradient_sync()` every trainable parameter's `.grad`
is the average over ranks of the local gradients (summed over micro-steps); buckets
are launched in index order on every rank (bucket i waits for bucket i-1), so the
ranks' collectives always match, whatever order the hooks fire in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.comms import AsyncAllReduce, CommThread
from parallel_lab.data_parallel.naive import check_unchanged, signature, trainable

#: torch DDP's default `bucket_cap_mb=25`.
DEFAULT_BUCKET_BYTES = 25 * 2**20
COMMS = ("builtin", "ring")


def _check_bucket_bytes(bucket_bytes: Any) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)):
        raise TypeError(f"bucket_bytes must be a number of bytes, got {type(bucket_bytes).__name__}")
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0 (bytes per bucket), got {bucket_bytes!r}")


def assign_buckets(params: Iterable[torch.Tensor], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of about `bucket_bytes`, in reverse registration order.

    Frozen parameters are left out; a tied (repeated) parameter counts once, at its
    first appearance. Walking the reversed list, a parameter joins the open bucket
    of its dtype and device; a bucket closes as soon as it holds >= `bucket_bytes`
    (so a parameter bigger than the cap gets a bucket of its own). torch DDP's rule.
    """
    _check_bucket_bytes(bucket_bytes)
    buckets: list[list[nn.Parameter]] = []
    open_: dict[tuple, tuple[list, list[int]]] = {}  # (dtype, device) -> (params, [bytes])
    for p in reversed(trainable(params)):
        key = (p.dtype, p.device)
        if key not in open_:
            open_[key] = ([], [0])
            buckets.append(open_[key][0])  # a bucket's place is where its first parameter was
        cur, size = open_[key]
        cur.append(p)
        size[0] += p.numel() * p.element_size()
        if size[0] >= bucket_bytes:
            del open_[key]
    return buckets


# ----------------------------------------------------------------------------- the wrapper
@dataclass
class Bucket:
    """One bucket: its parameters, the flat gradient buffer their `.grad`s view, and its state."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (numel,) flat gradients of `params`
    views: list[torch.Tensor]  # views[i] shaped like params[i], inside `buffer`
    ready: set = field(default_factory=set)  # ids of params whose gradient is in
    handle: Any = None  # the in-flight all-reduce

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class BucketedDDP(nn.Module):
    """Data parallel with gradient buckets whose all-reduces overlap backward (torch DDP's design).

    `comm="builtin"` all-reduces a bucket with gloo's/NCCL's asynchronous all-reduce;
    `comm="ring"` with `comms.ring_all_reduce` (from scratch) on a background thread,
    whose bytes are counted from the messages themselves. Call
    `finish_gradient_sync()` before the optimizer step (or `sync_on_step(optimizer)`
    once, to have every `optimizer.step()` call it).
    """

    def __init__(self, module: nn.Module, ctx: Any, bucket_bytes: float = DEFAULT_BUCKET_BYTES, group: Any = None,
                 comm: str = "builtin", broadcast_params: bool = True, hook: Any = None):  # fmt: skip
        super().__init__()
        if hook is not None and (not callable(hook) or comm != "ring"):
            raise ValueError(
                "hook must be callable as hook(ctx, bucket, group) and needs comm='ring' (it runs on the "
                f"comms thread, through the lab's collectives); got hook={hook!r}, comm={comm!r}"
            )
        self.hook = hook
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        _check_bucket_bytes(bucket_bytes)
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
        self.module, self.ctx, self.group, self.comm = module, ctx, group, comm
        self.bucket_bytes = bucket_bytes
        self.world = dist.get_world_size(group)
        self._signature = signature(module)
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, torch.Tensor]] = {}
        for i, params in enumerate(assign_buckets(module.parameters(), bucket_bytes)):
            self.buckets.append(self._make_bucket(i, params))
        self._next = 0  # the next bucket to launch, in index order
        self._syncing = True  # False inside no_sync()
        self._thread = CommThread(ctx.device) if comm == "ring" and self.world > 1 else None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params
        ]
        if broadcast_params and self.world > 1:
            self._broadcast_params()

    def _make_bucket(self, index: int, params: list[nn.Parameter]) -> Bucket:
        mem = getattr(self.ctx, "memory", None)
        with mem.category("grad") if mem is not None else contextlib.nullcontext():
            buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        if mem is not None:
            mem.register(buf, "grad")
        b = Bucket(index, params, buf, list(buf.split([p.numel() for p in params])))  # 1-D pieces
        for i, p in enumerate(params):
            b.views[i] = v = b.views[i].view_as(p)  # this parameter's gradient, inside the bucket
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v  # backward now accumulates straight into the bucket
            self._where[id(p)] = (b, v)
        return b

    def _broadcast_params(self) -> None:
        """Every replica starts from rank 0's weights (as torch DDP does when it wraps)."""
        with torch.no_grad():
            for b in self.buckets:
                flat = torch.cat([p.detach().reshape(-1) for p in b.params])  # (bucket numel,)
                comms.dist_broadcast(self.ctx, flat, src=0, group=self.group)
                for p, piece in zip(b.params, flat.split([p.numel() for p in b.params])):
                    p.copy_(piece.view_as(p))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_unchanged(self.module, self._signature, "BucketedDDP")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, backward only adds into `.grad`; the last micro-step, outside, syncs."""
        prev, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = prev

    # -- the gradient hook: runs inside backward, the moment p.grad is complete ---------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._syncing:
            return
        b, view = self._where[id(p)]
        if p.grad is not view:  # zero_grad(set_to_none=True) dropped our view: move back in
            view.copy_(p.grad)
            p.grad = view
        if id(p) in b.ready or b.handle is not None:
            raise RuntimeError(
                "BucketedDDP: a gradient arrived twice before finish_gradient_sync(); call it (or "
                "optimizer.step() after sync_on_step) between backwards, or use no_sync() to accumulate"
            )
        b.ready.add(id(p))
        self._launch_ready()

    def _launch_ready(self) -> None:
        # In index order only: every rank issues the same collectives in the same order.
        while self._next < len(self.buckets) and self._full(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    @staticmethod
    def _full(b: Bucket) -> bool:
        return len(b.ready) == len(b.params)

    def _launch(self, b: Bucket) -> None:
        if self.world == 1:
            b.handle = _Done()
            return
        if self.hook is not None:  # the hook leaves the average in the bucket (torch's comm-hook contract)
            b.handle = self._thread.submit(lambda: self.hook(self.ctx, b, self.group))
            return
        b.buffer.div_(self.world)  # sum of g/N = average (torch DDP divides first too)
        name = f"bucket {b.index}"
        if self._thread is None:
            b.handle = AsyncAllReduce(self.ctx, b.buffer, self.group, name, bucket=b.index)
        else:
            b.handle = self._thread.submit(lambda: comms.ring_all_reduce(self.ctx, b.buffer, self.group))

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce. Buckets whose gradients never came (parameters unused in
        this forward) are launched now with zeros for the missing ones. A no-op inside `no_sync()` and
        when nothing was launched since the last call."""
        check_unchanged(self.module, self._signature, "BucketedDDP")
        if not self._syncing or (self._next == 0 and not any(b.ready for b in self.buckets)):
            return
        for b in self.buckets[self._next :]:
            for p, v in zip(b.params, b.views):
                if id(p) not in b.ready:  # keeps what earlier micro-steps accumulated (zeros if none)
                    if p.grad is None:
                        v.zero_()
                    elif p.grad is not v:
                        v.copy_(p.grad)
                    p.grad = v
                    b.ready.add(id(p))
        self._launch_ready()
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.ready.clear()
        self._next = 0

    def sync_on_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Have `optimizer.step()` call `finish_gradient_sync()` first; returns the optimizer."""
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.finish_gradient_sync())
        return optimizer

    def bucket_table(self) -> list[dict]:
        """One row per bucket: index, bytes, parameter names (for the lesson's pictures)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [
            {"bucket": b.index, "bytes": b.nbytes, "params": [names[id(p)] for p in b.params]}
            for b in self.buckets
        ]


class _Done:
    def wait(self) -> None:
        return None


__all__ = ["COMMS", "DEFAULT_BUCKET_BYTES", "AsyncAllReduce", "Bucket", "BucketedDDP", "CommThread", "assign_buckets"]  # fmt: skip
