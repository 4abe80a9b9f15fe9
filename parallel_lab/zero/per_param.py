"""Per-parameter sharding: every parameter cut on its dim 0, the layout of PyTorch's FSDP2.

Lesson 20. Lesson 04's ZeRO-3 lays all trainable parameters end to end in one flat buffer and cuts it
into N equal slices: a slice boundary falls wherever it falls, often inside a parameter, and the
optimizer sees one (S,) tensor per rank. (FSDP1 does the same per wrapped unit, one `FlatParameter`
each; DeepSpeed's ZeRO-3 cuts each flattened parameter into N equal pieces.) FSDP2
(`torch.distributed.fsdp.fully_shard` in PyTorch 2.13) shards each parameter on dim 0: a `DTensor`
per parameter, placement `Shard(0)`, rank k holding rows [k c, (k+1) c) of a parameter with r rows,
c = ceil(r / N) (`torch.chunk`), the missing rows of the last ranks padded with zeros inside, while
`to_local()` shows only the real rows. Its documentation gives the reasons: "Per-parameter sharding
provides a more intuitive user experience, relaxes constraints around frozen parameters, and allows
for communication-free (sharded) state dicts, which otherwise require all-gathers in FSDP1."

What changes, with the bytes on the wire the same up to padding:
- each rank's optimizer tensor is one parameter's rows, in its trailing shape (here (c_i, *shape[1:])
  views, padding rows included; FSDP2's optimizer sees the `DTensor`s), so its state is per
  parameter and a checkpoint of it needs no gathering. An update local to a row (elementwise ones
  like Adam, a per-row norm) runs on the shard; one that needs the whole matrix (Shampoo, Muon) or a
  per-tensor norm (LAMB) still needs a gather or a reduction across ranks, in either layout;
- padding is per parameter (each one rounded up to N c_i rows), not once at the end;
- a unit's all-gather moves equal pieces from every rank (each rank's rows of every parameter of
  the unit, concatenated), and the gathered buffer is rank-major: rank 0's rows of every
  parameter, then rank 1's... A copy-out puts each parameter's rows in order in its own memory
  (FSDP2's `foreach_all_gather_copy_out`, which allocates that memory only once the gather is in);
  that copy is new. Backward copies each gradient's rows in, rank-major, before the reduce-scatter,
  where the flat layout copies the unit's gradients into its flat order: a copy either way;
- a checkpoint reshards parameter by parameter, on rows, with lesson 13's `resilience.reshard`
  (numel = the parameter's rows).
The lab keeps a frozen parameter whole on every rank, in both of its layouts (no gradient, no
optimizer state); FSDP2 shards frozen parameters too.

`PerParamZero3` is lesson 04's `Zero3` (the same hooks: gather before use, free after, prefetch,
saved tensors kept as where-not-what) with this layout under it.

Invariant: after every step the parameters equal one process's (up to summation order), and rank
k's shard of parameter i is rows [k c_i, (k+1) c_i) of it, zero-padded: what FSDP2's `to_local()`
holds, padding aside.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from parallel_lab.zero.comm import GradReducer, _label, all_gather_pieces, ring_reduce_scatter_pieces
from parallel_lab.zero.layout import ParamGroups, ShardStates, check_precision
from parallel_lab.zero.stage3 import Zero3

__all__ = ["PerParamLayout", "PerParamZero3", "dim0_shard", "per_param_state_bytes"]


def _rows(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a parameter cut on dim 0 (a 0-d tensor is one row of one)."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) else 1
    return rows, (n // rows if rows else 0)


def dim0_shard(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s (c, *shape[1:]) shard of `t`: rows [rank c, (rank+1) c), c = ceil(rows / N), zero-padded."""
    rows, _ = _rows(t.shape)
    c = math.ceil(rows / world_size)
    full = t.reshape(rows, *t.shape[1:]) if t.dim() else t.reshape(1)
    out = full.new_zeros((c, *full.shape[1:]))
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out[: hi - lo] = full[lo:hi]
    return out


class PerParamLayout:
    """Where every element lives when each parameter is cut on dim 0 (see the module docstring).

    Per parameter i: `rows[i]`, `rest[i]` elements per row, `c[i] = ceil(rows/N)` rows on every rank,
    a block of c[i] rest[i] elements. A unit's piece (the same size on every rank) is its parameters'
    blocks end to end; a rank's slice is its pieces of all units end to end: `shard` elements, the
    same on every rank. `offsets()` / `unit_range()` describe the param-major (unpadded) buffer a
    gathered unit is copied out into, as `ZeroLayout`'s do for the flat layout."""

    def __init__(self, shapes: list[tuple[int, ...]], unit_sizes: tuple[int, ...], world_size: int) -> None:
        if sum(unit_sizes) != len(shapes):
            raise ValueError("unit_sizes must add up to the number of parameters")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.unit_sizes = world_size, tuple(unit_sizes)
        self.shapes = [tuple(s) for s in shapes]
        self.numels = tuple(math.prod(s) for s in self.shapes)
        self.rows, self.rest = zip(*(_rows(s) for s in self.shapes)) if shapes else ((), ())
        self.c = tuple(math.ceil(r / world_size) for r in self.rows)
        self.block = tuple(c * r for c, r in zip(self.c, self.rest))  # elements of parameter i on a rank
        starts = [sum(unit_sizes[:u]) for u in range(len(unit_sizes))]
        self._units = [range(a, a + n) for a, n in zip(starts, unit_sizes)]
        self.unit_block = tuple(sum(self.block[i] for i in ids) for ids in self._units)  # a unit's piece
        self.unit_offset = tuple(sum(self.unit_block[:u]) for u in range(len(unit_sizes)))  # in a slice
        # where parameter i's block starts inside its unit's piece
        self.block_offset = tuple(
            i_off for ids in self._units for i_off in _running(self.block[i] for i in ids)
        )
        self._off = tuple(sum(self.numels[:i]) for i in range(len(self.numels) + 1))
        # [lo, hi) of each parameter's block in a rank's slice (read every step: computed once)
        self._slices = tuple(
            (
                self.unit_offset[u] + self.block_offset[i],
                self.unit_offset[u] + self.block_offset[i] + self.block[i],
            )
            for u, ids in enumerate(self._units)
            for i in ids
        )

    @classmethod
    def of(cls, groups: ParamGroups, world_size: int) -> PerParamLayout:
        return cls([tuple(p.shape) for p in groups.flat], tuple(len(g) for g in groups.params), world_size)

    @property
    def numel(self) -> int:
        """Ψ: trainable elements."""
        return sum(self.numels)

    @property
    def shard(self) -> int:
        """Elements every rank holds: sum over parameters of ceil(rows/N) x (elements per row)."""
        return sum(self.block)

    @property
    def padded(self) -> int:
        return self.shard * self.world_size

    @property
    def padding(self) -> int:
        """Zero rows, over all parameters and ranks (each parameter padded on its own)."""
        return self.padded - self.numel

    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the param-major (unpadded) buffer, and Ψ at the end."""
        return self._off

    def unit_params(self, u: int) -> range:
        return self._units[u]

    def unit_range(self, u: int) -> tuple[int, int]:
        """[a, b) of unit u in the param-major buffer (no padding in it)."""
        ids = self._units[u]
        return self._off[ids.start], self._off[ids.stop]

    def pieces(self, u: int) -> list[tuple[int, int]]:
        """Per rank k: [k w, (k+1) w) of unit u's rank-major gather buffer, w = its piece (equal pieces)."""
        w = self.unit_block[u]
        return [(k * w, (k + 1) * w) for k in range(self.world_size)]

    def param_slice(self, i: int) -> tuple[int, int]:
        """[lo, hi) of parameter i's block in a rank's slice."""
        return self._slices[i]


def _running(sizes) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def per_param_state_bytes(
    layout: PerParamLayout, optimizer: str = "adam", precision: str = "fp32"
) -> dict[str, int]:
    """Model-state bytes one rank holds under per-parameter sharding: the bytes per parameter of
    `costmodel.bytes_per_param` times the padded per-rank count `layout.shard`."""
    from parallel_lab import costmodel

    check_precision(precision)
    b = costmodel.bytes_per_param(optimizer, precision)
    out = {k: layout.shard * b[k] for k in ("param", "grad", "optim")}
    out["total"] = sum(out.values())
    return out


class _PerParamReducer(GradReducer):
    """`GradReducer` with the copy-in: a unit's gradients written rank-major (each rank's rows of each
    parameter, zero-padded) before the reduce-scatter of equal pieces."""

    @torch.no_grad()
    def _reduce(self, u: int) -> None:
        lay, S = self.layout, self.layout.world_size
        w = lay.unit_block[u]
        if self.on_unit_ready is not None:
            self.on_unit_ready(u)  # backward is done with the unit: its gathered weights go first
        with _label(self.ctx.memory, "grad"):
            buf = torch.zeros(S, w, dtype=self.dtype, device=self.device)  # (S, piece) rank-major
        for i, p in zip(lay.unit_params(u), self.params[u]):
            if p.grad is not None:
                c, rest, q = lay.c[i], lay.rest[i], lay.block_offset[i]
                padded = p.grad.new_zeros(S * c, rest)  # (S c, rest): the rows, then the padding rows
                padded[: lay.rows[i]] = p.grad.reshape(lay.rows[i], rest)
                buf[:, q : q + c * rest] = padded.view(S, c * rest)  # rank k's c rows into its piece
                del padded
            p.grad = None  # each full gradient is freed as soon as it is copied in
        self.count[u] = -len(self.params[u]) - 1  # done for this pass
        with _label(self.ctx.memory, "comm"):
            mine = ring_reduce_scatter_pieces(self.ctx, buf.view(-1), lay.pieces(u), 0, self.group)  # (w,)
        o = lay.unit_offset[u]
        self.sink(u, o, o + w, mine)
        del buf, mine
        self.ctx.recorder.sample_memory(f"reduce-scattered {self.names[u] if self.names else u}")


class PerParamZero3(Zero3):
    """ZeRO-3 with each parameter sharded on dim 0 (FSDP2's layout; see the module docstring).

    Used as `Zero3`: `PerParamZero3(ctx, model, optimizer="adam", lr=1e-3, group=None, units=None)`,
    then `loss.backward()`, `.step()`, `.zero_grad()`. `shards()` gives this rank's shard of every
    parameter by name, as the optimizer sees it."""

    def __init__(self, ctx, model: nn.Module, optimizer: Any = "adam", precision: str = "fp32",
                 units: list[nn.Module] | None = None, prefetch: bool = True, group=None,
                 **optim_kwargs: Any) -> None:  # fmt: skip
        if "gather" in optim_kwargs:
            raise ValueError(
                "PerParamZero3 gathers parameters as they are (gather='param'); pass no `gather`"
            )
        self._gathered: dict[int, torch.Tensor] = {}
        super().__init__(ctx, model, optimizer, precision, units, prefetch, group, **optim_kwargs)
        self.reducer.remove()  # Zero3's reducer reads the flat layout: ours copies gradients in rank-major
        self.reducer = _PerParamReducer(ctx, self.groups.params, self.layout, self.states, self.rank, group,
                                        on_unit_ready=self._unit_backward_done, names=self.groups.names,
                                        on_backward_end=self._backward_end)  # fmt: skip

    # -- states: one (shard,) tensor, the optimizer on per-parameter views of it --------------
    def _build_states(self, params: list[nn.Parameter], optim_kwargs: dict) -> ShardStates:
        self.layout = lay = PerParamLayout.of(self.groups, self.world_size)
        work = check_precision(self.precision)
        shard = torch.zeros(
            lay.shard, dtype=work, device=self.device
        )  # (shard,) this rank's rows of every parameter
        for i, p in enumerate(params):
            lo, hi = lay.param_slice(i)
            shard[lo:hi] = dim0_shard(p.detach(), self.world_size, self.rank).reshape(-1)
        grad_shard = torch.zeros(lay.shard, dtype=work, device=self.device)
        master = shard.to(torch.float32, copy=True) if self.precision == "mixed" else None
        base = master if master is not None else shard
        # the optimizer's tensors: leaves sharing `base`'s storage, one per parameter, (c_i, *shape[1:])
        self._views = []
        for i, p in enumerate(params):
            lo, hi = lay.param_slice(i)
            shape = (lay.c[i], *p.shape[1:]) if p.dim() else (1,)
            self._views.append(base[lo:hi].detach().view(shape).requires_grad_())
        opt = self.optimizer_cls(self._views, **optim_kwargs)
        return ShardStates(3, None, shard, None, grad_shard, master, opt)

    def _step_optimizer(self, grad: torch.Tensor) -> None:
        """The averaged (shard,) gradient handed to each parameter's view, then the update."""
        st = self.states
        for i, v in enumerate(self._views):
            lo, hi = self.layout.param_slice(i)
            v.grad = grad[lo:hi].view(v.shape).to(v.dtype)
        with self.ctx.span("optimizer.step", "optimizer"):
            st.optimizer.step()
        for v in self._views:
            v.grad = None
        if st.master is not None:
            st.shard.copy_(st.master)  # round the fp32 master into the working weights

    # -- gather: equal pieces, rank-major, then the copy-out ---------------------------------
    def _issue(self, u: int) -> None:
        if self.bufs[u] is not None:
            return
        lay, w = self.layout, self.layout.unit_block[u]
        with _label(self.ctx.memory, "comm"):
            # (S piece,) rank-major
            gathered = torch.empty(self.world_size * w, dtype=self.states.shard.dtype, device=self.device)
        o = lay.unit_offset[u]
        mine = self.states.shard.detach()[o : o + w]
        self.pending[u] = all_gather_pieces(self.ctx, mine, lay.pieces(u), gathered, 0, self.group,
                                            self.GATHER_TAG + u)  # fmt: skip
        self._gathered[u] = gathered
        # issued, not arrived: the unit's param-major memory is allocated by the copy-out, as FSDP2 does,
        # so a prefetch in flight holds the gather buffer only
        self.bufs[u] = self._placeholder

    @torch.no_grad()
    def _arrived(self, u: int) -> None:
        """The copy-out: rank-major (S, piece) -> each parameter's rows in order, its padding rows dropped."""
        lay, S = self.layout, self.world_size
        a, b = lay.unit_range(u)
        off = lay.offsets()
        g = self._gathered.pop(u).view(S, lay.unit_block[u])  # (S, piece)
        with _label(self.ctx.memory, "param"):
            buf = torch.empty(b - a, dtype=g.dtype, device=self.device)  # (unit,) param-major
        for i in lay.unit_params(u):
            c, rest, q = lay.c[i], lay.rest[i], lay.block_offset[i]
            rows = g[:, q : q + c * rest].reshape(
                S * c, rest
            )  # (S c, rest): parameter i's rows, padding last
            buf[off[i] - a : off[i + 1] - a].view(lay.rows[i], rest).copy_(rows[: lay.rows[i]])
            del rows
        del g
        self.bufs[u] = buf
        self._ptr2unit[buf.untyped_storage().data_ptr()] = u

    def _free(self, u: int) -> None:
        if self.bufs[u] is not None and self.pending[u] is not None:  # issued, never used: nothing bound
            self.pending[u].wait()  # finish its messages first
            self.pending[u] = None
            self._gathered.pop(u, None)
            self.bufs[u] = None
            return
        super()._free(u)

    # -- reading -------------------------------------------------------------------------
    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every trainable parameter by name, (c_i, *shape[1:]), padding included."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: v.detach().clone() for p, v in zip(self.groups.flat, self._views)}
