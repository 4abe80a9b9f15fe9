"""ZeRO stage 3: parameters sharded too, gathered unit by unit just before use and freed just after.

Rajbhandari et al. 2020, "ZeRO", §5.3 (P_os+g+p) and §7.2.3 (1.5x communication), with the next
unit's gather overlapping the current unit's compute. Between steps a rank holds only its (S,) slice of the
parameters, gradients and optimizer states: 16Ψ/N bytes with mixed-precision Adam.

A step, for units u = root, blocks.0, blocks.1, ... (`zero.layout.group_params`):
- forward: before unit u runs (a forward pre-hook) its parameters are all-gathered into a
  fresh buffer and the module's Parameters become views of it; the NEXT unit's all-gather
  is issued right away (async), so it travels while u computes; after u (a forward hook)
  the views are dropped and the buffer freed. Tensors autograd saves for backward that
  live in the buffer (weights, their transposes) are not kept: a saved-tensor hook stores
  (unit, shape, stride, offset) instead and rebuilds the view from the re-gathered buffer
  in backward. That is what makes "freed" real: nothing pins the gathered bytes.
- backward: a hook on each unit's output fires before the unit's backward: gather it
  again (usually already prefetched) and prefetch the previous unit. When the unit's last
  gradient is accumulated, `GradReducer` copies the unit's gradients into one buffer (each
  freed as it is copied), the unit's parameters are freed, and the buffer is reduce-scattered
  into the (S,) slice. The gradients are born one by one as autograd makes them: a unit-sized
  buffer made ready before the unit's backward would sit beside the prefetched next unit and
  raise the peak by one unit's bytes.
- step: each rank updates its slice with its optimizer states. Nothing to all-gather:
  the next forward gathers what it needs.

Per rank per step this moves 3 x (P - S) elements each way (gather in forward, again in
backward, reduce-scatter): 1.5x plain DP's ring all-reduce.

`gather="fp8"` (lesson 18; torchtitan does this for FSDP2 with float8 training): each rank casts
its piece of a unit to e4m3 with its own scale (its amax) before the all-gather and sends the scale
beside it, so a gather moves 1 byte per parameter (+4 per piece) instead of 4 (fp32) or 2 (bf16);
every rank then computes with the same fp8-rounded weights, while the optimizer keeps updating its
full-precision slice.

Invariant: outside a unit's forward/backward its Parameters are empty placeholders and no
gathered byte of it is alive; `full_parameters()` gathers the real values for inspection.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn

from parallel_lab.precision import amax_to_scale, quantize_fp8
from parallel_lab.zero.comm import GradReducer, _label, all_gather_pieces
from parallel_lab.zero.optimizer import ZeroBase, _zero_shard

GATHERS = ("param", "fp8")


class _Packed:
    """A saved tensor that was a view of unit `u`'s gathered buffer: where, not what."""

    __slots__ = ("offset", "size", "stride", "u")

    def __init__(self, u: int, t: torch.Tensor) -> None:
        self.u, self.size, self.stride, self.offset = u, t.size(), t.stride(), t.storage_offset()


class Zero3(ZeroBase):
    """ZeRO stage 3 over `model` on every rank of `group` (see the module docstring).

    `Zero3(ctx, model, optimizer="adam", lr=1e-3)`, then `loss = model(...)`, `loss.backward()`,
    `zero.step()`, `zero.zero_grad()`. `units` default to the children of every
    `nn.ModuleList`; parameters outside them (or shared between them, like tied
    embeddings) form the root unit. `prefetch=False` gathers each unit only when needed.
    """

    GATHER_TAG = 1 << 21  # all-gather tags: GATHER_TAG + unit

    def __init__(self, ctx, model: nn.Module, optimizer: Any = "adam", precision: str = "fp32",
                 units: list[nn.Module] | None = None, prefetch: bool = True, group=None,
                 gather: str = "param", **optim_kwargs: Any) -> None:  # fmt: skip
        if gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
        super().__init__(ctx, model, 3, optimizer, precision, units, group, optim_kwargs)
        self.prefetch, self.gather = bool(prefetch), gather
        self._fp8: dict[int, tuple[torch.Tensor, list[int]]] = {}
        n_units = len(self.groups.params)
        self.bufs: list[torch.Tensor | None] = [None] * n_units
        self.pending: list[Any] = [None] * n_units
        self._ptr2unit: dict[int, int] = {}
        self._t0 = [0.0] * n_units
        self._in_backward = [False] * n_units
        self._saved_hooks = None
        self._placeholder = torch.empty(0, dtype=self.states.shard.dtype, device=self.device)
        self._shapes = [p.shape for p in self.groups.flat]
        self._unit_of = [u for u in range(n_units) for _ in self.layout.unit_params(u)]
        for p in self.groups.flat:
            p.data = self._placeholder  # the original full tensors are released here
        self.reducer = GradReducer(ctx, self.groups.params, self.layout, self.states, self.rank,
                                   group, on_unit_ready=self._unit_backward_done, names=self.groups.names,
                                   on_backward_end=self._backward_end)  # fmt: skip
        mods = self.groups.modules
        self._hooks = [
            mods[0].register_forward_pre_hook(self._root_pre),
            mods[0].register_forward_hook(self._root_post),
        ]
        for u in range(1, n_units):
            self._hooks.append(mods[u].register_forward_pre_hook(partial(self._unit_pre, u)))
            self._hooks.append(mods[u].register_forward_hook(partial(self._unit_post, u)))
        self._signature = self._model_signature()
        self._register_memory()

    # -- gather / free -----------------------------------------------------------
    def _issue(self, u: int) -> None:
        """Start all-gathering unit u into a fresh buffer (no-op if it is gathered or on its way)."""
        if self.bufs[u] is not None:
            return
        a, b = self.layout.unit_range(u)
        lo, hi = self.layout.pieces(u)[self.rank]
        s = self.rank * self.layout.shard
        with _label(self.ctx.memory, "param"):
            buf = torch.empty(b - a, dtype=self.states.shard.dtype, device=self.device)  # (unit,)
        mine = self.states.shard.detach()[lo - s : hi - s]
        if self.gather == "fp8":
            self.pending[u] = self._issue_fp8(u, mine)
        else:
            self.pending[u] = all_gather_pieces(self.ctx, mine, self.layout.pieces(u), buf, a, self.group,
                                                self.GATHER_TAG + u)  # fmt: skip
        self.bufs[u] = buf
        self._ptr2unit[buf.untyped_storage().data_ptr()] = u

    def _issue_fp8(self, u: int, mine: torch.Tensor):
        """Start gathering unit u as e4m3 pieces, each followed by its float32 scale (4 bytes)."""
        amax = float(mine.abs().max()) if mine.numel() else 0.0
        scale = amax_to_scale(amax, "e4m3")
        packed = torch.cat([quantize_fp8(mine, "e4m3", scale).view(torch.uint8),
                            torch.tensor([scale], dtype=torch.float32, device=mine.device).view(torch.uint8)])  # fmt: skip
        sizes = [hi - lo + 4 for lo, hi in self.layout.pieces(u)]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        with _label(self.ctx.memory, "comm"):
            out = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # (unit + 4p,)
        self._fp8[u] = (out, starts)
        pieces = [(st, st + n) for st, n in zip(starts, sizes)]
        return all_gather_pieces(self.ctx, packed, pieces, out, 0, self.group, self.GATHER_TAG + u)

    def _unpack_fp8(self, u: int) -> None:
        """Decode the gathered e4m3 pieces into the unit's buffer, each with its own scale."""
        out, starts = self._fp8.pop(u)
        a = self.layout.unit_range(u)[0]
        for (lo, hi), st in zip(self.layout.pieces(u), starts):
            n = hi - lo
            scale = (
                out[st + n : st + n + 4].clone().view(torch.float32)
            )  # (1,): copied, a view needs alignment
            vals = out[st : st + n].view(torch.float8_e4m3fn).float()  # (n,)
            self.bufs[u][lo - a : hi - a].copy_(vals / scale)

    def _ensure(self, u: int) -> None:
        """Unit u gathered (waiting for its prefetch if one is in flight) and its Parameters bound."""
        if self.bufs[u] is None:
            self._issue(u)
        if self.pending[u] is not None:
            self.pending[u].wait()
            self.pending[u] = None
            self._arrived(u)
            a = self.layout.unit_range(u)[0]
            off = self.layout.offsets()
            for i in self.layout.unit_params(u):
                p = self.groups.flat[i]
                p.data = self.bufs[u][off[i] - a : off[i + 1] - a].view(self._shapes[i])
            self.ctx.recorder.sample_memory(f"gathered {self.groups.names[u]}")

    def _arrived(self, u: int) -> None:
        """Unit u's gather is complete: what the bytes need before the Parameters view `bufs[u]`."""
        if self.gather == "fp8":
            self._unpack_fp8(u)

    def _free(self, u: int) -> None:
        """Drop unit u's gathered buffer: its Parameters go back to empty placeholders."""
        if self.bufs[u] is None:
            return
        if self.pending[u] is not None:  # a prefetch nobody used: finish its messages first
            self.pending[u].wait()
            self.pending[u] = None
            self._fp8.pop(u, None)
        for i in self.layout.unit_params(u):
            self.groups.flat[i].data = self._placeholder
        del self._ptr2unit[self.bufs[u].untyped_storage().data_ptr()]
        self.bufs[u] = None
        self.ctx.recorder.sample_memory(f"freed {self.groups.names[u]}")

    # -- saved tensors: keep where, not what ------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        u = self._ptr2unit.get(st.data_ptr()) if st.nbytes() else None
        return t if u is None else _Packed(u, t)

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, _Packed):
            self._ensure(x.u)  # normally gathered already by the pre-backward hook
            return self.bufs[x.u].as_strided(x.size, x.stride, x.offset)
        return x

    # -- hooks -------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        self._check_model()
        if self._saved_hooks is not None:  # a forward that raised left it on: drop it
            self._saved_hooks.__exit__(None, None, None)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._ensure(0)
        if self.prefetch and len(self.bufs) > 1:
            self._issue(1)

    def _root_post(self, module, args, output) -> None:
        self._saved_hooks.__exit__(None, None, None)
        self._saved_hooks = None
        self._after_forward(0, output)

    def _unit_pre(self, u: int, module, args) -> None:
        self._ensure(u)
        if self.prefetch and u + 1 < len(self.bufs):
            self._issue(u + 1)  # travels while unit u computes
        self._t0[u] = self.ctx.recorder.mark()

    def _unit_post(self, u: int, module, args, output) -> None:
        rec = self.ctx.recorder
        rec.add_event(f"forward {self.groups.names[u]}", "compute", self._t0[u], rec.mark())
        self._after_forward(u, output)

    def _after_forward(self, u: int, output: Any) -> None:
        outs = [t for t in _tensors(output) if t.requires_grad]
        if torch.is_grad_enabled() and outs:
            for t in outs:
                t.register_hook(partial(self._pre_backward, u))
        self._free(u)

    def _pre_backward(self, u: int, grad: torch.Tensor) -> None:
        if self._in_backward[u]:
            return  # a unit with several outputs: once is enough
        self._in_backward[u] = True
        self.reducer.ensure_callback()
        self._ensure(u)
        if self.prefetch:
            prev = len(self.bufs) - 1 if u == 0 else u - 1  # backward walks the units in reverse
            if prev >= 1:
                self._issue(prev)
        self._t0[u] = self.ctx.recorder.mark()

    def _unit_backward_done(self, u: int) -> None:
        if u > 0:
            rec = self.ctx.recorder
            rec.add_event(f"backward {self.groups.names[u]}", "compute", self._t0[u], rec.mark())
        self._free(u)

    def _backward_end(self) -> None:
        for u in range(len(self.bufs)):
            self._free(u)
        self._in_backward = [False] * len(self.bufs)

    # -- the step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slice; the next forward gathers the new values."""
        self._check_model()
        if self.states.grad_shard is None:  # no backward since zero_grad(set_to_none=True)
            return
        self._step_optimizer(self.states.grad_shard / self.world_size)  # (S,) averaged

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the (S,) gradient slice, or free it with `set_to_none=True` (like torch's .grad)."""
        _zero_shard(self.states, set_to_none)
        for p in self.groups.flat:
            p.grad = None

    def _check_model(self) -> None:
        super()._check_model()
        for i, p in enumerate(self.groups.flat):
            if self.bufs[self._unit_of[i]] is None and p.numel() != 0:
                raise ValueError(
                    f"model: parameter {self._names.get(id(p), '?')!r} was given new data after wrapping; "
                    "under ZeRO-3 its values live in the shards: build a new Zero3 for the changed model"
                )

    # -- inspection ----------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value (a collective: call it on every rank), by name, as copies."""
        out: dict[str, torch.Tensor] = {}
        ids = {id(p): i for i, p in enumerate(self.groups.flat)}
        mode, self.gather = self.gather, "param"  # the real values, not the fp8 ones the model computes with
        try:
            for u in range(len(self.bufs)):
                self._ensure(u)
                for name, p in self.model.named_parameters(remove_duplicate=False):
                    if ids.get(id(p), -1) in self.layout.unit_params(u):
                        out[name] = p.detach().clone()
                self._free(u)
        finally:
            self.gather = mode
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                out[name] = p.detach().clone()
        return out

    def remove(self) -> None:
        """Take the hooks off (the model keeps its placeholders: it is no longer usable alone)."""
        for h in self._hooks:
            h.remove()
        self.reducer.remove()


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


__all__ = ["Zero3"]
