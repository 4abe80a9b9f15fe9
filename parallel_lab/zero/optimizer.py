"""ZeRO stages 0-2: data parallelism that stops keeping N copies of the optimizer states and gradients.

Rajbhandari, Rasley, Ruwase & He (2020), "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §5.1-5.2 (P_os, P_os+g) and §7 (communication). The idea: every rank of plain data parallelism runs the same optimizer
update on the same numbers, so let each rank update only its 1/N.

- Stage 0 (plain DP, for comparison): gradients all-reduced (ring), every rank runs the
  whole optimizer. Model states per rank: 16Ψ bytes with mixed-precision Adam.
- Stage 1 (P_os): gradients reduce-scattered after backward (`comms.ring_reduce_scatter`):
  rank r receives the sum of its slice only, updates that slice with its 1/N of the
  optimizer states, and the updated slices are all-gathered (ring) into every rank's full
  copy. 4Ψ + 12Ψ/N bytes.
- Stage 2 (P_os+g): each unit's gradients are reduce-scattered as soon as backward is done
  with the unit and freed at once (`zero.comm.GradReducer`); only the (S,) gradient slice
  is kept. 2Ψ + 14Ψ/N bytes.

Stage 3 (parameters too) is `zero.stage3.Zero3`; `ZeRO(ctx, model, stage=...)` builds either.
The flat layout, the padding and the per-rank tensors are in `zero.layout`.

Communication per rank per step (§7.2): reduce-scatter + all-gather = (P - S) + (P - S)
elements each way, exactly what a ring all-reduce of the P-element buffer moves: ZeRO-1/2
cost no more bandwidth than plain DP.

`overlap_param_gather=True` (lesson 18; Megatron-LM's distributed optimizer with its overlapped
parameter gather): stages 1-2 start the all-gather of the updated slices unit by unit at the end
of `step()` and return at once; each unit's forward pre-hook waits for that unit's pieces only, so
the gathers of later units travel while earlier units compute. Same bytes, less exposed time
(`exposed_gather_seconds` sums the time a rank waited for parameters, with or without overlap).

Invariant: after every `step()` (with overlap: before each unit's forward) all ranks hold
bit-identical parameters, equal up to summation order to one process training on the union of
the ranks' batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.runtime import device as mesh
from parallel_lab.zero.comm import GradReducer, _label, all_gather_pieces, ring_all_gather_
from parallel_lab.zero.layout import (
    ZeroLayout,
    bind_params,
    build_states,
    check_precision,
    check_stage,
    group_params,
    resolve_optimizer,
    state_bytes,
)


class ZeroBase:
    """What every stage shares: validation, the layout, the model check, memory labels."""

    def __init__(self, ctx, model: nn.Module, stage: int, optimizer: Any, precision: str,
                 units: list[nn.Module] | None, group, optim_kwargs: dict) -> None:  # fmt: skip
        self.stage = check_stage(stage)
        check_precision(precision)
        self.optimizer_cls, self.optimizer_name = resolve_optimizer(optimizer, optim_kwargs)
        self.ctx, self.model, self.group, self.precision = ctx, model, group, precision
        self.groups = group_params(model, units)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = ZeroLayout.of(self.groups, self.world_size)
        params = self.groups.flat
        devices = {p.device for p in model.parameters()}
        if len(devices) != 1:
            raise ValueError(f"model must live on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._names = {id(p): n for n, p in model.named_parameters()}
        with torch.no_grad():
            self.states = self._build_states(params, optim_kwargs)

    def _build_states(self, params: list[nn.Parameter], optim_kwargs: dict):
        """This rank's tensors (`zero.layout.build_states`); offload overrides where they live."""
        return build_states(
            params,
            self.layout,
            self.stage,
            self.rank,
            self.precision,
            self.optimizer_cls,
            optim_kwargs,
            self.device,
        )

    # -- the model must stay the one we wrapped ---------------------------------
    def _model_signature(self) -> list[tuple]:
        return [(id(p), p.requires_grad, p.dtype) for p in self.model.parameters()]

    def _check_model(self) -> None:
        now = self._model_signature()
        if now != self._signature:
            before = {i: (rg, dt) for i, rg, dt in self._signature}
            what = "a parameter was added, removed or replaced"
            for n, p in self.model.named_parameters():
                if id(p) not in before:
                    what = f"{n!r} is a new Parameter object"
                    break
                if before[id(p)] != (p.requires_grad, p.dtype):
                    what = f"{n!r} changed requires_grad or dtype"
                    break
            raise ValueError(
                f"model: its parameters changed after wrapping ({what}). ZeRO laid the parameters out "
                "in its flat buffers when it was built: build a new ZeRO wrapper for the changed model."
            )

    def _register_memory(self) -> None:
        mem = self.ctx.memory
        if mem is None:
            return
        mem.register_module(self.model)
        st = self.states
        for t, cat in ((st.flat, "param"), (st.shard, "param"), (st.flat_grad, "grad"),
                       (st.grad_shard, "grad"), (st.master, "optim")):  # fmt: skip
            if t is not None:
                mem.register(t, cat)
        mem.register_optimizer(st.optimizer)

    # -- reading ---------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's slice (its `state` holds m and v for S elements)."""
        return self.states.optimizer

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's model states by category, counted from its tensors."""
        out = state_bytes(self.states)
        frozen = sum(p.numel() * p.element_size() for p in self.groups.frozen)
        out["param"] += frozen  # replicated, never sharded
        out["total"] += frozen
        return out

    def _step_optimizer(self, grad: torch.Tensor) -> None:
        """Run the optimizer on this rank's slice with `grad` (already averaged)."""
        st = self.states
        st.opt_param.grad = grad if grad.dtype == st.opt_param.dtype else grad.to(st.opt_param.dtype)
        with self.ctx.span("optimizer.step", "optimizer"):
            st.optimizer.step()
        st.opt_param.grad = None
        if st.master is not None:
            st.shard.copy_(st.master)  # round the fp32 master into the 16-bit working weights


class ZeroOptimizer(ZeroBase):
    """ZeRO stage 0 (plain DP), 1 (optimizer states sharded) or 2 (gradients too).

    Usage on every rank: `zero = ZeroOptimizer(ctx, model, stage=1, optimizer="adam", lr=1e-3)`,
    then `loss.backward(); zero.step(); zero.zero_grad()` as with a torch optimizer. The
    model's trainable parameters become views of one flat buffer; `optimizer` is "adam",
    "adamw" or "sgd" (or the class), with its keyword arguments. `units` (default: the
    children of every `nn.ModuleList`) are the groups whose gradients stage 2 reduces together.
    """

    GATHER_TAG = 1 << 22  # overlapped parameter gathers: GATHER_TAG + unit

    def __init__(self, ctx, model: nn.Module, stage: int = 1, optimizer: Any = "adam", precision: str = "fp32",
                 units: list[nn.Module] | None = None, group=None, overlap_param_gather: bool = False,
                 **optim_kwargs: Any) -> None:  # fmt: skip
        if check_stage(stage) == 3:
            raise ValueError("stage 3 shards the parameters too: use Zero3, or ZeRO(ctx, model, stage=3)")
        if overlap_param_gather and stage == 0:
            raise ValueError(
                "overlap_param_gather needs stage 1 or 2 (stage 0 all-reduces; nothing to gather)"
            )
        super().__init__(ctx, model, stage, optimizer, precision, units, group, optim_kwargs)
        self.overlap_param_gather = bool(overlap_param_gather)
        self._gather_watch = mesh.Stopwatch(ctx.device)  # device time on a GPU (a wait() only orders streams)
        self._gathers: list[Any] = [None] * len(self.groups.params)
        self._gather_hooks = []
        if self.overlap_param_gather:
            for u, mod in enumerate(self.groups.modules):
                self._gather_hooks.append(
                    mod.register_forward_pre_hook(lambda m, a, u=u: self._wait_gather(u))
                )
        params = self.groups.flat
        bind_params(params, self.layout, self.states.flat)  # the model now reads the flat buffer
        self._ptrs = [p.data_ptr() for p in params]
        self.reducer = None
        if self.stage == 2:
            self.reducer = GradReducer(ctx, self.groups.params, self.layout, self.states, self.rank, group,
                                       names=self.groups.names)  # fmt: skip
        else:
            self._attach_grads()
        self._signature = self._model_signature()  # after binding: "mixed" made them 16-bit
        self._register_memory()

    def _attach_grads(self) -> None:
        """Stages 0-1: each .grad is a view of the flat gradient buffer; backward adds into it in place."""
        off = self.layout.offsets()
        for i, p in enumerate(self.groups.flat):
            p.grad = self.states.flat_grad[off[i] : off[i + 1]].view(p.shape)

    def _collect_grads(self) -> None:
        """Make sure flat_grad holds the gradients even if someone replaced or cleared a .grad."""
        off = self.layout.offsets()
        for i, p in enumerate(self.groups.flat):
            view = self.states.flat_grad[off[i] : off[i + 1]]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
        self._attach_grads()

    def _check_model(self) -> None:
        super()._check_model()
        for p, ptr in zip(self.groups.flat, self._ptrs):
            if p.data_ptr() != ptr:
                raise ValueError(
                    f"model: parameter {self._names.get(id(p), '?')!r} no longer reads ZeRO's flat buffer "
                    "(its .data was replaced after wrapping, e.g. by model.to() or load_state_dict(assign=True))"
                )

    def _wait_gather(self, u: int) -> None:
        """Unit u's updated pieces have arrived (the forward pre-hook of the unit, with overlap)."""
        if self._gathers[u] is not None:
            with self._gather_watch():
                self._gathers[u].wait()
            self._gathers[u] = None

    @property
    def exposed_gather_seconds(self) -> float:
        """Seconds this rank's work waited for parameters (the gathers' time not hidden behind compute).
        On a GPU, reading it waits for the GPU (`Stopwatch.seconds`): read it once, after the steps."""
        return self._gather_watch.seconds

    def wait_param_gather(self) -> None:
        """Every unit's gather finished (before anything reads or writes the whole flat buffer)."""
        for u in range(len(self._gathers)):
            self._wait_gather(u)

    def _issue_param_gather(self) -> None:
        """Start all-gathering every unit's updated pieces into the flat buffer; returns at once."""
        flat = self.states.flat
        for u in range(len(self._gathers)):
            a, b = self.layout.unit_range(u)
            pieces = self.layout.pieces(u)
            lo, hi = pieces[self.rank]
            self._gathers[u] = all_gather_pieces(self.ctx, flat[lo:hi], pieces, flat[a:b], a, self.group,
                                                 self.GATHER_TAG + u)  # fmt: skip

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients across ranks, update, and leave identical parameters everywhere."""
        self.wait_param_gather()  # our slice is about to change: the last step's sends of it must be done
        self._check_model()
        ctx, st, n = self.ctx, self.states, self.world_size
        if self.stage == 0:
            self._collect_grads()
            grad = comms.ring_all_reduce(ctx, st.flat_grad, self.group, op="avg")  # (Ψ,) in place
        elif self.stage == 1:
            self._collect_grads()
            with _label(ctx.memory, "comm"):
                grad = comms.ring_reduce_scatter(ctx, st.flat_grad, self.group)  # (S,) our slice, summed
            grad.div_(n)
        else:
            if st.grad_shard is None:  # no backward since zero_grad(set_to_none=True): nothing to do
                return
            grad = st.grad_shard / n  # (S,) summed during backward
        self._step_optimizer(grad)
        del grad
        if self.stage > 0 and self.overlap_param_gather:
            self._issue_param_gather()  # each unit's forward waits for its own pieces
        elif self.stage > 0:
            with self._gather_watch():
                ring_all_gather_(ctx, st.flat, self.group)  # every rank's updated slice, everywhere

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients. Stages 0-1 keep their flat buffer (the .grads are views of it);
        stage 2 keeps its (S,) slice, or frees it with `set_to_none=True` (the next backward
        allocates it again), as `torch.optim.Optimizer.zero_grad` does with .grad."""
        if self.states.flat_grad is not None:
            self.states.flat_grad.zero_()
            self._attach_grads()
        else:
            _zero_shard(self.states, set_to_none)
            for p in self.groups.flat:
                p.grad = None


def _zero_shard(states, set_to_none: bool) -> None:
    if set_to_none:
        states.grad_shard = None
    elif states.grad_shard is not None:
        states.grad_shard.zero_()


__all__ = ["ZeroBase", "ZeroOptimizer"]
