"""Where every ZeRO byte lives: the flat layout, the per-rank states, and their count on `meta`.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §5) partitions the model states of data parallelism over the N
ranks. This module is the arithmetic and the allocation; `zero/optimizer.py` / `zero/stage3.py` move
the bytes. The same `build_states` runs in a real training run and on `meta` tensors,
so the per-rank bytes of a 7B model under each stage are counted, not computed.

The flat layout (DeepSpeed's convention). The trainable parameters (tied weights once,
frozen ones left out: they have no gradient and no optimizer state) are laid end to end,
unit by unit, in one flat buffer of Ψ elements, padded with zeros to P = N·S elements,
S = ceil(Ψ/N). Rank r owns the contiguous slice [rS, (r+1)S): its gradient shard, its
optimizer states and (stage 3) its parameter shard. The padding (P - Ψ < N elements)
sits at the end, in the last rank's slice, and always stays zero.

A *unit* is a group of modules whose parameters travel together (a transformer block):
stage 2 reduce-scatters a unit's gradients as soon as backward is done with it, stage 3
gathers a unit's parameters before it runs. A unit covers the contiguous range
[a_u, b_u) of the flat buffer (the last one runs to P, padding included); its piece on
rank k is the intersection with [kS, (k+1)S), possibly empty.

Invariant: the bytes a rank holds for a sharded state are exactly S elements, i.e.
`costmodel.model_state_bytes` (which uses ceil(Ψ/N)); a replicated state held in the
padded flat buffer (stage 1-2 parameters, stage 1 gradients) is P elements, Ψ plus the
padding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn as nn

#: Optimizers ZeRO can shard: their update is elementwise, so updating a slice of the flat
#: buffer with the slice's states equals updating the whole (LAMB/LARS-style layer norms,
#: Shampoo's matrices would need the full tensor).
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
#: "fp32": everything fp32 (4 + 4 + 8 bytes/param with Adam). "mixed": 16-bit working
#: weights and gradients (bf16 here: the CPU computes in it), fp32 master copy and states
#: (2 + 2 + 12), the ZeRO paper's accounting.
PRECISIONS = {"fp32": torch.float32, "mixed": torch.bfloat16}
STAGES = (0, 1, 2, 3)


# ----------------------------------------------------------------------------- validation
def check_stage(stage: Any) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 = plain data parallel), got {stage!r}")
    return int(stage)


def check_precision(precision: Any) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def resolve_optimizer(optimizer: Any, kwargs: dict) -> tuple[type[torch.optim.Optimizer], str]:
    """(optimizer class, costmodel name) for a name ("adam", "adamw", "sgd") or one of those classes."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a name or a class, not an optimizer instance: ZeRO builds its own "
            "optimizer over this rank's shard (pass e.g. optimizer='adam', lr=1e-3)"
        )
    cls = OPTIMIZERS.get(optimizer) if isinstance(optimizer, str) else optimizer
    if cls not in OPTIMIZERS.values():
        raise ValueError(
            f"optimizer must be one of {tuple(OPTIMIZERS)} (or torch.optim.Adam/AdamW/SGD), got {optimizer!r}: "
            "ZeRO shards optimizers whose update is elementwise"
        )
    name = next(k for k, v in OPTIMIZERS.items() if v is cls)
    if name == "sgd" and kwargs.get("momentum", 0):
        name = "momentum"
    return cls, name


# ----------------------------------------------------------------------------- units
def default_units(model: nn.Module) -> list[nn.Module]:
    """Every child of every `nn.ModuleList` (transformer blocks, MLP layers) is a unit."""
    return [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m.children()]


@dataclass
class ParamGroups:
    """Trainable parameters grouped by unit; unit 0 is the root (everything outside the units)."""

    modules: list[nn.Module]  # [model, *units]
    names: list[str]  # "root", "blocks.0", ...
    params: list[list[nn.Parameter]]  # per unit, each parameter once
    frozen: list[nn.Parameter] = field(default_factory=list)

    @property
    def flat(self) -> list[nn.Parameter]:
        return [p for ps in self.params for p in ps]


def group_params(model: nn.Module, units: list[nn.Module] | None = None) -> ParamGroups:
    """Assign each trainable parameter to one unit; shared (tied) or unowned ones go to the root.

    Units whose parameters are all frozen are dropped: nothing of theirs is sharded.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    units = default_units(model) if units is None else list(units)
    names = {id(m): n for n, m in model.named_modules()}
    for m in units:
        if not isinstance(m, nn.Module) or id(m) not in names or m is model:
            raise ValueError("units must be submodules of model (not model itself)")
    if len({id(m) for m in units}) != len(units):
        raise ValueError("units must not repeat a module")
    inner = {id(s) for m in units for s in m.modules() if s is not m}
    if any(id(m) in inner for m in units):
        raise ValueError("units must not be nested inside one another")
    owners: dict[int, set[int]] = {}
    for i, m in enumerate(units):
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(i)
    groups: list[list[nn.Parameter]] = [[] for _ in range(len(units) + 1)]
    frozen = []
    for p in model.parameters():  # each Parameter once, in registration order
        if not p.requires_grad:
            frozen.append(p)
            continue
        own = owners.get(id(p), set())
        groups[next(iter(own)) + 1 if len(own) == 1 else 0].append(p)
    if not any(groups):
        raise ValueError("model has no trainable parameters: nothing to shard")
    keep = [i for i, g in enumerate(groups) if g or i == 0]
    mods = [model, *units]
    return ParamGroups(
        modules=[mods[i] for i in keep],
        names=["root" if i == 0 else names[id(mods[i])] for i in keep],
        params=[groups[i] for i in keep],
        frozen=frozen,
    )


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ZeroLayout:
    """Flat-buffer arithmetic: Ψ, S, P, each parameter's range, each unit's pieces per rank."""

    numels: tuple[int, ...]  # trainable parameters, in flat order
    unit_sizes: tuple[int, ...]  # parameters per unit, in flat order
    world_size: int

    def __post_init__(self) -> None:
        if sum(self.unit_sizes) != len(self.numels):
            raise ValueError("unit_sizes must add up to the number of parameters")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    @classmethod
    def of(cls, groups: ParamGroups, world_size: int) -> ZeroLayout:
        return cls(tuple(p.numel() for p in groups.flat), tuple(len(g) for g in groups.params), world_size)

    @property
    def numel(self) -> int:
        """Ψ: trainable elements."""
        return sum(self.numels)

    @property
    def shard(self) -> int:
        """S = ceil(Ψ/N): elements every rank owns (the last rank's slice ends in padding)."""
        return math.ceil(self.numel / self.world_size)

    @property
    def padded(self) -> int:
        """P = N·S: the flat buffer with its padding."""
        return self.shard * self.world_size

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        return (0, *itertools.accumulate(self.numels))

    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the flat buffer, and Ψ at the end."""
        return self._offsets

    def param_range(self, i: int) -> tuple[int, int]:
        off = self.offsets()
        return off[i], off[i + 1]

    def unit_params(self, u: int) -> range:
        start = sum(self.unit_sizes[:u])
        return range(start, start + self.unit_sizes[u])

    def unit_range(self, u: int) -> tuple[int, int]:
        """[a, b) of unit u in the flat buffer; the last unit's range includes the padding."""
        off = self.offsets()
        ids = self.unit_params(u)
        a = off[ids.start]
        b = self.padded if u == len(self.unit_sizes) - 1 else off[ids.stop]
        return a, b

    def owned(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, u: int) -> list[tuple[int, int]]:
        """Per rank k: unit u's range intersected with [kS, (k+1)S) (lo == hi when empty)."""
        a, b = self.unit_range(u)
        out = []
        for k in range(self.world_size):
            lo, hi = self.owned(k)
            lo, hi = max(a, lo), min(b, hi)
            out.append((lo, max(lo, hi)))
        return out


# ----------------------------------------------------------------------------- states
@dataclass
class ShardStates:
    """The tensors one rank keeps between steps (see the module docstring for sizes)."""

    stage: int
    flat: torch.Tensor | None  # replicated working weights: Ψ (stage 0) or P (1, 2); None at 3
    shard: torch.Tensor  # the working weights this rank updates: a view of flat, or its own (S,)
    flat_grad: torch.Tensor | None  # replicated gradients: Ψ (stage 0) or P (1); None at 2, 3
    grad_shard: torch.Tensor | None  # (S,) reduced gradients at stages 2, 3
    master: torch.Tensor | None  # "mixed": fp32 copy of `shard`, what the optimizer steps
    optimizer: torch.optim.Optimizer

    @property
    def opt_param(self) -> torch.Tensor:
        return self.master if self.master is not None else self.shard

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Model-state tensors by costmodel category (master copy counts as optimizer state)."""
        param = [self.flat if self.flat is not None else self.shard]
        grad = [t for t in (self.flat_grad, self.grad_shard) if t is not None]
        optim = [self.master] if self.master is not None else []
        for st in self.optimizer.state.values():
            optim += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"param": param, "grad": grad, "optim": optim}


def copy_range(params: list[torch.Tensor], layout: ZeroLayout, lo: int, hi: int, out: torch.Tensor) -> None:
    """out[:] = the flat buffer's [lo, hi) (zeros past Ψ), read piecewise from the parameters."""
    out.zero_()
    off = layout.offsets()
    for i, p in enumerate(params):
        a, b = max(lo, off[i]), min(hi, off[i + 1])
        if a < b:
            out[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - off[i] : b - off[i]])


def build_states(
    params: list[torch.Tensor], layout: ZeroLayout, stage: int, rank: int, precision: str,
    optimizer_cls: type[torch.optim.Optimizer], optim_kwargs: dict, device: torch.device | str,
) -> ShardStates:  # fmt: skip
    """Allocate what rank `rank` holds at `stage`, filled from `params` (their values, any dtype).

    Works on `meta` (no storage): that is how zero.meta counts a 7B model's bytes.
    """
    work = check_precision(precision)
    S, r = layout.shard, rank
    lo, hi = layout.owned(r)
    kw = {"device": device}
    flat = flat_grad = grad_shard = master = None
    if stage == 3:
        shard = torch.empty(S, dtype=work, **kw)  # (S,) this rank's parameter slice
        copy_range(params, layout, lo, hi, shard)
    else:
        n = layout.numel if stage == 0 else layout.padded
        flat = torch.empty(n, dtype=work, **kw)  # (Ψ,) or (P,) replicated
        copy_range(params, layout, 0, n, flat)
        shard = flat if stage == 0 else flat[lo:hi]  # (S,) view: updating it updates flat
    if stage in (0, 1):
        flat_grad = torch.zeros(flat.numel(), dtype=work, **kw)  # (Ψ,) or (P,)
    else:
        grad_shard = torch.zeros(S, dtype=work, **kw)  # (S,)
    if precision == "mixed":
        master = shard.detach().to(torch.float32, copy=True)  # (S,) fp32 master copy (stage 0: (Ψ,))
    opt_param = (master if master is not None else shard.detach()).requires_grad_()
    if master is not None:
        master = opt_param
    else:
        shard = opt_param  # fp32: the optimizer steps the working weights in place
    return ShardStates(
        stage, flat, shard, flat_grad, grad_shard, master, optimizer_cls([opt_param], **optim_kwargs)
    )


def bind_params(params: list[nn.Parameter], layout: ZeroLayout, flat: torch.Tensor) -> None:
    """Make each parameter a view of its range of `flat`, so updating `flat` updates the model."""
    off = layout.offsets()
    for i, p in enumerate(params):
        p.data = flat[off[i] : off[i + 1]].view(p.shape)


def state_bytes(states: ShardStates) -> dict[str, int]:
    """Bytes of this rank's model states by category, from the tensors themselves (meta too)."""
    from parallel_lab.runtime.memory_state import count_bytes

    out = {k: count_bytes(v) if v else 0 for k, v in states.tensors().items()}
    out["total"] = sum(out.values())
    return out


__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STAGES",
    "ParamGroups",
    "ShardStates",
    "ZeroLayout",
    "bind_params",
    "build_states",
    "check_precision",
    "check_stage",
    "copy_range",
    "default_units",
    "group_params",
    "resolve_optimizer",
    "state_bytes",
]
