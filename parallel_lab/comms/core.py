"""The machinery every collective shares: argument checks, the traced exchange, byte accounting.

The ring algorithms are the bandwidth-optimal all-reduce of Patarasuk & Yuan (2009),
"Bandwidth optimal all-reduce algorithms for clusters of workstations", the one
Baidu brought to deep learning and NCCL runs as its ring; the trees are binomial
trees (MPICH's broadcast/reduce, Thakur, Rabenseifner & Gropp 2005).

This file holds the machinery (argument checks, the traced exchange `TracedOp`, `Handle`);
the ops live beside it, one idea per file, and `comms/__init__` re-exports them so
`comms.X` is the one name everything uses: comms/ring.py (ring, naive, all-to-all),
comms/tree.py (binomial trees), comms/p2p.py (send/recv), comms/builtin.py
(traced torch.distributed built-ins), comms/cost.py (the byte formulas).

Conventions
- Every function takes the launch `ctx` first and works on `group` (None means
  `ctx.group`, and that None means the world). `src`, `dst` and `peer` arguments
  are ranks *within the group*; timeline `peers` are global ranks.
- Every call records one span of kind "comm" on `ctx.recorder` (args: op,
  bytes_sent, bytes_recv, numel, dtype, peers, steps) and adds its payload bytes to
  `recorder.count_bytes(op, sent, recv)`. From-scratch collectives count the bytes
  their own messages actually carried; the `dist_*` wrappers of the built-ins
  count the *nominal* volume of the textbook algorithm (ring for all-reduce,
  reduce-scatter and all-gather, binomial tree for broadcast/reduce, pairwise for
  all-to-all, flat for gather/scatter), because the backend does not report what it
  sent; e.g. gloo's reduce_scatter is an all-reduce inside and moves about twice that.
- With `ctx.check_shapes` every collective first all-gathers (numel, dtype, shape)
  so a rank passing a different tensor gets a ValueError naming the ranks instead
  of a hang. That metadata exchange is neither traced nor counted.

Chunking and the exact byte formula (invariant the tests check)
A tensor of n elements is cut into p chunks by divmod: with q, m = divmod(n, p),
chunk k has c_k = q + (1 if k < m else 0) elements. Ring reduce-scatter leaves the
fully reduced chunk r on rank r; ring all-gather starts from it. With b bytes per
element and indices mod p, rank r sends and receives:

    reduce_scatter: sent_r = (n - c_r) b           recv_r = (n - c_{r-1}) b
    all_gather:     sent_r = (n - c_{r+1}) b       recv_r = (n - c_r) b
    all_reduce:     sent_r = (2n - c_r - c_{r+1}) b  recv_r = (2n - c_{r-1} - c_r) b

For p | n every c_k = n/p and all-reduce moves 2(p-1)/p * n*b per rank each way,
the lower bound for any all-reduce. `ring_bytes_per_rank` computes these.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.comms.cost import chunk_sizes

#: dtypes the from-scratch collectives accept (what gloo and NCCL both reduce).
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
REDUCE_OPS = ("sum", "avg", "max", "min")
_DIST_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_DTYPE_CODES = (*SUPPORTED_DTYPES, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
# Bound once: the shape check is plumbing, not the lesson; graders that forbid built-in
# collectives inside a learner's function (by patching torch.distributed) don't see it.
_metadata_all_gather = dist.all_gather
_metadata_all_reduce = dist.all_reduce
_MAX_SEGMENTS = 64  # per chunk, in the pipelined ring
_META_DIMS = 8  # shape dims carried by the shape check (more are folded into the last one)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view when possible (in-place ops then reach the caller's tensor), else a copy."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _chunks(flat: torch.Tensor, p: int) -> list[torch.Tensor]:
    return list(flat.split(chunk_sizes(flat.numel(), p)))  # views, divmod sizes


def _combine(a: torch.Tensor, b: torch.Tensor, op: str, out: torch.Tensor) -> torch.Tensor:
    """out <- a (op) b elementwise, in out's dtype (bf16 rounds after every add, as gloo does)."""
    f = torch.add if op in ("sum", "avg") else torch.maximum if op == "max" else torch.minimum
    return f(a, b, out=out)


# ----------------------------------------------------------------------------- plumbing
def _group(ctx, group):
    return group if group is not None else getattr(ctx, "group", None)


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def group_size_rank(ctx, group=None) -> tuple[int, int]:
    """(size, this rank's index) of the group a comms call with this `group` would use."""
    return _size_rank(_group(ctx, group))


def global_rank(ctx, group, r: int) -> int:
    """The global rank of group rank `r` (for labels: a trace names global ranks)."""
    return _global(_group(ctx, group), r)


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _check_dtype(tensor: torch.Tensor, what: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} has dtype {tensor.dtype}; supported dtypes are {names}")


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def _check_rank(name: str, r: int, p: int) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < p:
        raise ValueError(f"{name} must be a rank in the group, 0 <= {name} < {p}, got {r!r}")


#: Every traced collective, by name: a rank's call is fingerprinted by its index here.
COLLECTIVE_NAMES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
    "tree_broadcast", "tree_reduce", "tree_all_reduce", "ring_reduce_scatter", "ring_all_gather",
    "ring_all_reduce", "naive_all_reduce",
)  # fmt: skip
_FINGERPRINT = 4  # name, reduce op, root, numel: the fields before dtype and shape


def check_same_shape(ctx, tensor: torch.Tensor, name: str, group=None, op: str | None = None,
                     root: int | None = None) -> None:  # fmt: skip
    """All ranks make the same call, or every rank raises ValueError naming each rank's call.

    The fingerprint compared: the collective (its name, so a ring on one rank and a tree on another
    is caught), the reduce op, the root, the element count, the dtype and the shape. One tiny
    all-reduce before the collective: cheap next to a silent disagreement, a crash inside gloo, or
    a hang that only a timeout would end. `launch(..., check_shapes=False)` turns it off.
    """
    p, _ = _size_rank(group)
    if p == 1 or not ctx.check_shapes:
        return
    shape = list(tensor.shape)
    if len(shape) > _META_DIMS:
        shape = shape[: _META_DIMS - 1] + [math.prod(shape[_META_DIMS - 1 :])]
    code = _DTYPE_CODES.index(tensor.dtype) if tensor.dtype in _DTYPE_CODES else 99
    which = COLLECTIVE_NAMES.index(name) if name in COLLECTIVE_NAMES else -1
    reduce_op = REDUCE_OPS.index(op) if op in REDUCE_OPS else -1
    meta = [which, reduce_op, -1 if root is None else root, tensor.numel(), code, tensor.dim(), *shape]
    meta += [-1] * (_META_DIMS - len(shape))
    if _same_everywhere(hash(tuple(meta)) & ((1 << 62) - 1), group, tensor.device):
        return
    mine = torch.tensor(meta, dtype=torch.int64, device=tensor.device)
    every = [torch.empty_like(mine) for _ in range(p)]
    _metadata_all_gather(every, mine, group=group)
    rows = [e.tolist() for e in every]
    if any(row != rows[0] for row in rows):

        def show(row: list[int]) -> str:
            what = COLLECTIVE_NAMES[row[0]] if 0 <= row[0] < len(COLLECTIVE_NAMES) else "another collective"
            extra = (f" {REDUCE_OPS[row[1]]}" if row[1] >= 0 else "") + (
                f" root={row[2]}" if row[2] >= 0 else ""
            )
            dt = _DTYPE_CODES[row[4]] if row[4] < len(_DTYPE_CODES) else "other dtype"
            dims = tuple(row[6 : 6 + min(row[5], _META_DIMS)])
            return f"{what}{extra} of {str(dt).replace('torch.', '')} {dims}"

        desc = "; ".join(f"rank {_global(group, r)}: {show(row)}" for r, row in enumerate(rows))
        raise ValueError(
            f"{name}: the ranks made different calls ({desc}); every rank must call the same collective "
            "with the same reduce op, root, shape and dtype"
        )


def gather_values(ctx, values: Sequence[int], group=None) -> list[list[int]]:
    """Every rank's `values` (a few ints, as many on every rank), in group-rank order.

    For agreement checks a shape cannot carry (a layout flag, a local error code): every rank sees
    every rank's values, so every rank can raise the same error instead of one raising while its
    peers wait in the next collective. Not traced: it is plumbing, like the shape check."""
    group = _group(ctx, group)
    p, _ = _size_rank(group)
    if p == 1:
        return [list(values)]
    mine = torch.tensor(list(values), dtype=torch.int64, device=getattr(ctx, "device", None) or "cpu")
    every = [torch.empty_like(mine) for _ in range(p)]
    _metadata_all_gather(every, mine, group=group)
    return [e.tolist() for e in every]


def _same_everywhere(h: int, group, device) -> bool:
    """True when every rank of `group` holds the same number `h`: min(h) and max(h) (as -min(-h))
    agree only then. One all-reduce of two numbers: cheaper than gathering every fingerprint (a few
    times so at 4 ranks on gloo). Its cost is latency, one more message round per collective; a
    recursive-doubling exchange over point-to-point messages measured no better."""
    lo_hi = torch.tensor([h, -h], dtype=torch.int64, device=device)
    _metadata_all_reduce(lo_hi, op=dist.ReduceOp.MIN, group=group)
    return lo_hi[0].item() == -lo_hi[1].item()


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor, numel: int, slot: int) -> torch.Tensor:
    """A receive buffer kept between calls (per thread, device, dtype and slot): fresh pages
    would be zeroed by the OS on every call, which costs as much as a reduction. Per thread,
    so a collective running on a background thread (bucketed DDP) never shares one."""
    key = (threading.get_ident(), like.device, like.dtype, slot)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = like.new_empty(numel)
    return buf[:numel]


def post_p2p(group, sends=(), recvs=(), tag: int = 0) -> list:
    """Start every send and receive given (as one `batch_isend_irecv` on NCCL); returns the works.

    The one place the lab posts point-to-point messages (a test checks that no other module
    calls isend/irecv/send/recv). `sends` and `recvs` are (tensor, group rank) pairs; empty
    tensors are skipped; a triple (tensor, group rank, tag) gives that message a tag of its own
    (gloo matches by it; NCCL by posting order, ignoring it). Why one batch: NCCL pairs messages by the order they are posted, not
    by tag, runs each batch as one kernel on its stream, and a bare isend/irecv creates a lazy
    two-rank communicator whose creation can wait on another's. A batch posts the exchange
    together on the group's communicator, as torch.distributed.pipelining does. gloo matches
    by tag and runs every message on its own: there the messages are posted one by one (receives
    first), which skips the batch's bookkeeping (~0.1 ms an exchange of a few KB, measured on 2
    ranks, where the whole exchange took ~0.3 ms)."""
    recvs = [(m[0], _global(group, m[1]), m[2] if len(m) > 2 else tag) for m in recvs if m[0].numel() > 0]
    sends = [(m[0], _global(group, m[1]), m[2] if len(m) > 2 else tag) for m in sends if m[0].numel() > 0]
    if not recvs and not sends:
        return []
    if independent_messages(group):
        works = [dist.irecv(t, r, group, k) for t, r, k in recvs]
        return works + [dist.isend(t, r, group, k) for t, r, k in sends]
    ops = [dist.P2POp(dist.irecv, t, r, group, k) for t, r, k in recvs]
    ops += [dist.P2POp(dist.isend, t, r, group, k) for t, r, k in sends]
    return dist.batch_isend_irecv(ops)


def independent_messages(group) -> bool:
    """True when every posted message runs on its own (gloo: matched by sender and tag, in
    posting order). NCCL runs a batch as one kernel that ends only when all its messages have
    moved, so a receive must not be posted in a batch before the step that makes its data."""
    return dist.get_backend(group) == "gloo"


def check_device(ctx, tensor: torch.Tensor | None, what: str = "tensor") -> None:
    """A collective's tensor must live on the rank's device (`ctx.device`).

    gloo accepts CPU tensors anywhere; NCCL rejects them ("No backend type associated with
    device type cpu"), so the rule is checked here, on every device, to fail the same way on
    a laptop and on a GPU box."""
    device = getattr(ctx, "device", None)
    if tensor is None or device is None or tensor.device == torch.device(device):
        return
    raise ValueError(
        f"{what} is on {tensor.device} but this rank computes on {device}: create it with "
        f"device=ctx.device (or move it with .to(ctx.device)) before a collective"
    )


class TracedOp:
    """One traced collective: knows its group, tallies the bytes its messages carry."""

    def __init__(self, ctx, name: str, tensor: torch.Tensor | None, group, trace_steps: bool = False):
        check_device(ctx, tensor)
        self.ctx, self.name, self.group = ctx, name, _group(ctx, group)
        self.p, self.me = _size_rank(self.group)
        self.sent = self.recv = self.steps = 0
        self.peers: set[int] = set()
        self.trace_steps = trace_steps
        self.args = {
            "op": name,
            "numel": 0 if tensor is None else tensor.numel(),
            "dtype": "" if tensor is None else str(tensor.dtype).replace("torch.", ""),
        }

    def __enter__(self):
        self._span = self.ctx.recorder.span(self.name, kind="comm", **self.args)
        self._span_args = self._span.__enter__()  # the event's args dict: totals go in at the end
        return self

    def __exit__(self, *exc):
        self._span_args.update(
            bytes_sent=self.sent, bytes_recv=self.recv, peers=sorted(self.peers), steps=self.steps
        )
        if exc[0] is None:
            self.ctx.recorder.count_bytes(self.name, self.sent, self.recv)
        return self._span.__exit__(*exc)

    def xchg(
        self,
        send: torch.Tensor | None,
        dst: int,
        recv: torch.Tensor | None,
        src: int,
        phase: str = "step",
        tag: int = 0,
    ) -> None:
        """Send `send` to group rank `dst` while receiving `recv` from `src`; empty tensors are skipped.
        Both ends of a message must give it the same `tag` (see `post`)."""
        t0 = self.ctx.recorder.mark()
        works = self.post(send, dst, recv, src, tag)
        for w in works:
            w.wait()
        if self.trace_steps:
            self.ctx.recorder.add_event(
                f"{self.name}:{phase}",
                "comm",
                t0,
                self.ctx.recorder.mark(),
                parent=self.name,
                step=self.steps,
            )
        self.steps += 1

    def buffer(self, like: torch.Tensor, numel: int, slot: int | None = None) -> torch.Tensor:
        """A receive buffer: kept between calls when `slot` is given, fresh otherwise; counted
        as "comm" memory when the launch tracks memory."""
        mem = getattr(self.ctx, "memory", None)
        if mem is None:
            return like.new_empty(numel) if slot is None else _scratch(like, numel, slot)
        with mem.category("comm"):  # labelled from birth, so peaks count it right
            buf = like.new_empty(numel) if slot is None else _scratch(like, numel, slot)
        return mem.register(buf, "comm")  # a cached buffer may predate the tracker

    def combine(self, acc: torch.Tensor, x: torch.Tensor, op: str, out: torch.Tensor) -> torch.Tensor:
        """`_combine`, drawn on the compute lane when tracing steps (the adds between messages)."""
        t0 = self.ctx.recorder.mark()
        res = _combine(acc, x, op, out)
        if self.trace_steps:
            self.ctx.recorder.add_event(
                f"{self.name}:add", "compute", t0, self.ctx.recorder.mark(), parent=self.name
            )
        return res

    def post(self, send, dst, recv, src, tag: int = 0) -> list:
        """Start a send to `dst` and a receive from `src` together (`post_p2p`), tallying both;
        returns the works to wait on. gloo matches a receive to a message by sender and `tag`, in
        posting order: a collective that posts receives ahead of time gives each message of the
        call its own tag, so an early receive cannot take a message meant for another step (gloo's
        own collectives take a fresh tag each call). NCCL ignores tags and matches by order."""
        sends = [(send, dst)] if send is not None and send.numel() > 0 else []
        recvs = [(recv, src)] if recv is not None and recv.numel() > 0 else []
        for t, r in sends:
            self.sent += t.numel() * t.element_size()
            self.peers.add(_global(self.group, r))
        for t, r in recvs:
            self.recv += t.numel() * t.element_size()
            self.peers.add(_global(self.group, r))
        return post_p2p(self.group, sends, recvs, tag)

    def nominal(self, sent_recv: tuple[int, int], peers: Sequence[int]) -> None:
        """Book the textbook volume of a built-in collective (the backend does not report its own)."""
        self.sent, self.recv = sent_recv
        self.peers.update(_global(self.group, r) for r in peers)
        self.steps += 1


class Handle:
    """An issued asynchronous op; `.wait()` finishes it, closes its span (issue -> wait), books its bytes."""

    def __init__(self, ctx, name: str, works: list, args: dict, sent: int, recv: int, result: Any = None):
        self.ctx, self.name, self.works, self.args = ctx, name, works, args
        self.sent, self.recv, self.result = sent, recv, result
        self.start, self.done = ctx.recorder.mark(), False
        ctx.recorder.enter_comm(name)

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)

    def wait(self) -> Any:
        """Block until the op finished; returns its result (the received/reduced tensor)."""
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
            rec = self.ctx.recorder
            rec.add_event(
                self.name,
                "comm",
                self.start,
                rec.mark(),  # on a GPU: an event after the wait, i.e. when the op is really done
                **self.args,
                bytes_sent=self.sent,
                bytes_recv=self.recv,
            )
            rec.count_bytes(self.name, self.sent, self.recv)
            rec.leave_comm(self.name)
        return self.result
