"""ZeRO's communication: collectives over uneven pieces, and the stage 2/3 gradient reducer.

A ZeRO *unit* (a transformer block, see zero.layout) covers a range of the flat buffer
that cuts the ranks' slices unevenly: rank k's *piece* of the unit is the range inside
[kS, (k+1)S), often empty. So ZeRO's per-unit collectives move pieces:

- `all_gather_pieces` (stage 3, issued early so it overlaps compute: ZeRO §7): rank r posts its piece to every other rank and receives theirs straight
  into place, all at once, and waits later. Built from isend/irecv because gloo's built-in
  all_gather refuses uneven sizes. Sent (N-1)·|piece_r|, received (unit - |piece_r|).
- `ring_reduce_scatter_pieces` (stages 2, 3): the ring of `comms.ring_reduce_scatter`
  over uneven chunks, in place on a scratch copy, one receive buffer.
  Sent (unit - |piece_r|), received (unit - |piece_(r-1)|).
- `ring_all_gather_` (stages 1, 2): the ring all-gather of even slices, in place.

Summed over the units of a step (rank r's pieces add up to S), each pass moves exactly
(N-1)·S = P - S elements each way per rank: the ring's volume. ZeRO-2 therefore moves
what ZeRO-1 moves, and ZeRO-3's three passes (gather, gather again, reduce-scatter) are
1.5x that (§7.2). Every call records a "comm" span and books its bytes.

Invariant: every rank issues the same collectives in the same order (the layout is the
same everywhere); asynchronous ones carry their own message tag, so one in flight never
matches another's messages.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel_lab import comms
from parallel_lab.zero.layout import ShardStates, ZeroLayout


def _peer(group, k: int) -> int:
    return k if group is None else dist.get_global_rank(group, k)


def all_gather_pieces(
    ctx, mine: torch.Tensor, pieces: list[tuple[int, int]], out: torch.Tensor, base: int, group=None, tag: int = 0
) -> comms.Handle:  # fmt: skip
    """Start an all-gather of pieces into `out` (covering flat range [base, base + out.numel()))."""
    comms.check_device(ctx, mine, "mine")
    comms.check_device(ctx, out, "out")
    p, me = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = pieces[me]
    out[lo - base : hi - base].copy_(mine)  # our own piece does not travel
    b = out.element_size()
    others = [k for k in range(p) if k != me]
    recvs = [(out[pieces[k][0] - base : pieces[k][1] - base], k) for k in others]
    sends = [(mine, k) for k in others]
    sent = sum(t.numel() for t, _ in sends) * b
    recv = sum(t.numel() for t, _ in recvs) * b
    works = comms.post_p2p(group, sends, recvs, tag)  # every peer's piece in one batch
    args = {"op": "all_gather", "numel": out.numel(), "dtype": str(out.dtype).replace("torch.", "")}
    return comms.Handle(ctx, "all_gather", works, args, sent, recv, out)


class _Traced:
    """One collective built here, traced like comms' own: a "comm" span, its bytes booked."""

    def __init__(self, ctx, name: str, t: torch.Tensor, numel: int, group) -> None:
        self.ctx, self.name, self.group = ctx, name, group
        self.p, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.sent = self.recv = 0
        self.args = {"op": name, "numel": numel, "dtype": str(t.dtype).replace("torch.", "")}

    def __enter__(self) -> _Traced:
        self._span = self.ctx.recorder.span(self.name, "comm", **self.args)
        self._args = self._span.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        self._args.update(bytes_sent=self.sent, bytes_recv=self.recv)
        if exc[0] is None:
            self.ctx.recorder.count_bytes(self.name, self.sent, self.recv)
        return self._span.__exit__(*exc)

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to group rank `dst` while receiving from `src`; empty tensors are skipped."""
        comms.check_device(self.ctx, send, "send")
        comms.check_device(self.ctx, recv, "recv")
        self.recv += recv.numel() * recv.element_size()
        self.sent += send.numel() * send.element_size()
        for w in comms.post_p2p(self.group, [(send, dst)], [(recv, src)]):
            w.wait()


def ring_reduce_scatter_pieces(
    ctx, flat: torch.Tensor, pieces: list[tuple[int, int]], base: int, group=None
) -> torch.Tensor:
    """Ring reduce-scatter of `flat` (flat range [base, ...)) cut at `pieces`; returns our summed piece.

    The ring of `comms.ring_reduce_scatter` over uneven chunks: p-1 steps, each rank
    sends its partial sum of one chunk to the right and adds what arrives from the left
    (empty chunks send nothing). In place on `flat`, a buffer the caller gives up, with
    one receive buffer: sent (unit - |piece_r|), received (unit - |piece_(r-1)|).
    """
    chunks = [flat[lo - base : hi - base] for lo, hi in pieces]
    with _Traced(ctx, "ring_reduce_scatter", flat, flat.numel(), group) as o:
        p, me = o.p, o.me
        if p == 1:
            return chunks[0]
        got_buf = flat.new_empty(max(c.numel() for c in chunks))  # (largest piece,)
        acc = chunks[(me - 1) % p]  # our contribution to the chunk that ends on the left
        for s in range(p - 1):
            k = (me - s - 2) % p  # the chunk arriving now
            got = got_buf[: chunks[k].numel()]
            o.exchange(acc, (me + 1) % p, got, (me - 1) % p)
            acc = chunks[k].add_(got)
        return acc  # chunk `me`, summed over every rank


def ring_all_gather_(ctx, flat: torch.Tensor, group=None) -> torch.Tensor:
    """In-place ring all-gather: rank r's slice of `flat` (N equal slices) ends up on every rank.

    `comms.ring_all_gather` with `flat` itself as the output (no (N, S) copy): p-1 steps,
    each forwarding the slice received last to the right; sent and received (P - S) each.
    """
    with _Traced(ctx, "ring_all_gather", flat, flat.numel() // dist.get_world_size(group), group) as o:
        p, me = o.p, o.me
        slices = flat.view(p, -1)  # (N, S)
        for s in range(p - 1):
            o.exchange(slices[(me - s) % p], (me + 1) % p, slices[(me - s - 1) % p], (me - 1) % p)
    return flat


# ----------------------------------------------------------------------------- stage 2/3 gradients
class GradReducer:
    """Reduce-scatters each unit's gradients the moment backward has produced all of them.

    A post-accumulate-grad hook counts the unit's parameters; the last one copies the
    unit's gradients into one buffer (padding zeros on the last unit), frees the full
    gradients at once (during backward, layer by layer, not after it: ZeRO §5.2), reduce-scatters the buffer (`ring_reduce_scatter_pieces`) and adds this rank's
    summed piece into `states.grad_shard` (S,; allocated here when a `zero_grad(set_to_none=True)`
    dropped it). An autograd-engine callback at the end of
    backward reduces units some of whose parameters got no gradient (counted as zero).
    """

    def __init__(self, ctx, params: list[list[torch.nn.Parameter]], layout: ZeroLayout,
                 states: ShardStates, rank: int, group=None,
                 on_unit_ready: Callable[[int], None] | None = None,
                 on_backward_end: Callable[[], None] | None = None,
                 names: list[str] | None = None,
                 sink: Callable[[int, int, int, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        self.ctx, self.params, self.layout, self.group, self.names = ctx, params, layout, group, names
        self.states, self.rank = states, rank
        self.dtype, self.device = states.shard.dtype, states.shard.device
        self.on_unit_ready, self.on_backward_end = on_unit_ready, on_backward_end
        self.sink = sink or self._add_to_shard  # where a reduced piece goes: (unit, lo, hi, piece)
        self.count = [0] * len(params)
        self.callback_queued = False
        # The hooks live on the parameters; holding the reducer weakly keeps the parameters
        # from keeping it (and through it themselves) alive in a cycle Python cannot see.
        me = weakref.ref(self)
        self.handles = [
            p.register_post_accumulate_grad_hook(_grad_hook(me, u)) for u, ps in enumerate(params) for p in ps
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def ensure_callback(self) -> None:
        """Queue `finish` to run when this backward pass ends (once per pass)."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _on_grad(self, u: int, p: torch.Tensor) -> None:
        if self.ctx.memory is not None and p.grad is not None:
            self.ctx.memory.register(p.grad, "grad")  # autograd made it inside backward: label it now
        self.ensure_callback()
        self.count[u] += 1
        if self.count[u] == len(self.params[u]):
            self._reduce(u)

    @torch.no_grad()
    def _reduce(self, u: int) -> None:
        mem = self.ctx.memory
        a, b = self.layout.unit_range(u)
        if self.on_unit_ready is not None:
            self.on_unit_ready(u)  # backward is done with the unit: stage 3 frees its weights before the copy
        with _label(mem, "grad"):  # the unit's gradients, flattened: still gradients
            flat = torch.empty(b - a, dtype=self.dtype, device=self.device)  # (unit,)
        offs = self.layout.offsets()  # from the layout: a freed unit's parameters are empty now
        for i, p in zip(self.layout.unit_params(u), self.params[u]):
            view = flat[offs[i] - a : offs[i + 1] - a]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            p.grad = None  # each full gradient is freed as soon as it is copied, not after backward
        flat[offs[self.layout.unit_params(u).stop] - a :].zero_()  # the last unit's padding
        self.count[u] = -len(self.params[u]) - 1  # done for this pass
        pieces = self.layout.pieces(u)
        with _label(mem, "comm"):
            mine = ring_reduce_scatter_pieces(self.ctx, flat, pieces, a, self.group)  # (|piece|,) summed
        lo, hi = pieces[self.rank]
        s = self.rank * self.layout.shard
        if hi > lo:
            self.sink(u, lo - s, hi - s, mine)  # our slice's [lo - s, hi - s)
        del flat, mine, view  # (a loop view would keep the buffer alive)
        self.ctx.recorder.sample_memory(f"reduce-scattered {self.names[u] if self.names else u}")

    def _add_to_shard(self, u: int, lo: int, hi: int, piece: torch.Tensor) -> None:
        """Default sink: accumulate into the (S,) gradient slice (made again after set_to_none)."""
        if self.states.grad_shard is None:
            with _label(self.ctx.memory, "grad"):
                self.states.grad_shard = torch.zeros(
                    self.layout.shard, dtype=self.dtype, device=self.device
                )  # (S,)
        self.states.grad_shard[lo:hi] += piece

    def finish(self) -> None:
        """End of backward: reduce units that got only some of their gradients."""
        for u, c in enumerate(self.count):
            if c > 0:
                self._reduce(u)
        self.count = [0] * len(self.params)
        self.callback_queued = False
        if self.on_backward_end is not None:
            self.on_backward_end()


def _grad_hook(reducer: weakref.ref, u: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        r = reducer()
        if r is not None:
            r._on_grad(u, p)

    return hook


def _label(mem, category: str):
    """`mem.category(category)` when memory is tracked, else nothing."""
    return mem.category(category) if mem is not None else contextlib.nullcontext()


__all__ = ["GradReducer", "all_gather_pieces", "ring_all_gather_", "ring_reduce_scatter_pieces"]
