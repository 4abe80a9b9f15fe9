"""ZeRO's memory, predicted and counted: the formula, its padding, and a 7B model on `meta` tensors.

The ZeRO paper (Rajbhandari et al. 2020, §5, Figure 1) gives model-state bytes per rank
for mixed-precision Adam (K = 12 bytes of optimizer state per parameter):

    stage 0: 16Ψ   stage 1: 4Ψ + 12Ψ/N   stage 2: 2Ψ + 14Ψ/N   stage 3: 16Ψ/N

and for Ψ = 7.5B on N = 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB (the ZeRO paper's Figure 1).
`costmodel.model_state_bytes` is that formula with Ψ/N rounded up to S = ceil(Ψ/N).
`count_state_bytes` builds the per-rank tensors with the very function a real run uses
(`zero.layout.build_states`) on the `meta` device, runs torch's own optimizer step on
them (so Adam really creates m and v), and counts their bytes: a 7B model costs nothing.

Precision. On CPU the lab trains in fp32: 4 (weights) + 4 (grads) + 8 (Adam m, v) = 16
bytes/param, the same total as mixed precision's 2 + 2 + 12 but split differently, so
stage 1 shards 8 of the 16 bytes in fp32 and 12 in mixed precision.
`precision="mixed"` (bf16 weights and grads, fp32 master + states) runs too.

Padding. Sharded states are S elements per rank, exactly the formula. Stages 1-2 keep
the replicated weights (and stage 1 the gradients) in the padded flat buffer of P = N·S
elements, so those measure (P - Ψ)·bytes more than the formula's Ψ·bytes: less than N
elements, zero when N divides Ψ. `expected_state_bytes` adds exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from parallel_lab import costmodel
from parallel_lab.zero.layout import (
    PRECISIONS,
    ZeroLayout,
    build_states,
    check_precision,
    check_stage,
    group_params,
    resolve_optimizer,
    state_bytes,
)

#: The paper's example: 7.5B parameters, 64 GPUs, mixed-precision Adam (GB = 1e9 bytes).
PAPER_PSI, PAPER_N = 7_500_000_000, 64
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def expected_state_bytes(layout: ZeroLayout, stage: int, optimizer: str = "adam",
                         precision: str = "fp32") -> dict[str, int]:  # fmt: skip
    """`costmodel.model_state_bytes` plus the padding our flat buffers really hold (module docstring)."""
    stage = check_stage(stage)
    check_precision(precision)
    out = costmodel.model_state_bytes(layout.numel, layout.world_size, stage, optimizer, precision)
    b = costmodel.bytes_per_param(optimizer, precision)
    if stage in (1, 2):
        out["param"] += layout.padding * b["param"]
    if stage == 1:
        out["grad"] += layout.padding * b["grad"]
    out["total"] = out["param"] + out["grad"] + out["optim"]
    return out


def _meta_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        from parallel_lab.runtime.memory import MemoryTracker  # noqa: F401 - loads memory_state without the import cycle
        from parallel_lab.runtime.memory_state import meta_copy

        return meta_copy(model)
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"model() must return an nn.Module, got {type(built).__name__}")
        return built
    raise TypeError(f"model must be an nn.Module or a callable building one, got {type(model).__name__}")


def count_state_bytes(
    model: nn.Module | Callable[[], nn.Module], world_size: int, stage: int, rank: int = 0,
    optimizer: Any = "adam", precision: str = "mixed", units: list[nn.Module] | None = None,
) -> dict[str, int]:  # fmt: skip
    """Model-state bytes rank `rank` holds under ZeRO `stage` on `world_size` ranks, counted on `meta`.

    `model` is a module (copied to meta) or a zero-argument callable that builds one
    (built on meta: a 7B model costs no memory). Same layout and allocation code as a
    real run; one real torch optimizer step creates the optimizer states.
    Frozen parameters count as "param" (replicated).
    """
    stage = check_stage(stage)
    check_precision(precision)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size), got {rank!r}")
    cls, _ = resolve_optimizer(optimizer, {})
    meta = _meta_model(model)
    if units is not None:  # units name submodules of the original: find their twins by name
        names = {id(m): n for n, m in model.named_modules()} if isinstance(model, nn.Module) else {}
        twins = dict(meta.named_modules())
        units = [twins[names[id(m)]] for m in units]
    groups = group_params(meta, units)
    layout = ZeroLayout.of(groups, world_size)
    with torch.no_grad():
        states = build_states(groups.flat, layout, stage, rank, precision, cls, {"lr": 1e-3}, "meta")
    states.opt_param.grad = torch.zeros_like(states.opt_param)
    states.optimizer.step()  # creates m and v (meta: shapes only)
    states.opt_param.grad = None
    out = state_bytes(states)
    frozen = sum(p.numel() * p.element_size() for p in groups.frozen)
    out["param"] += frozen
    out["total"] += frozen
    out["numel"] = layout.numel
    return out


class _Stack(nn.Module):
    """`layers` bias-free Linear(width, width): a model of exactly layers·width² parameters."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))


def paper_model() -> nn.Module:
    """A 7.5B-parameter model (75 x Linear(10000, 10000)) for the paper's example: build it on meta."""
    return _Stack(75, 10_000)


def paper_table(world_size: int = PAPER_N, precision: str = "mixed") -> list[dict[str, Any]]:
    """Per stage: the paper's GB, the formula's, and the bytes counted on a meta 7.5B model (rank 0)."""
    if precision not in PRECISIONS:
        check_precision(precision)
    rows = []
    for stage in (0, 1, 2, 3):
        counted = count_state_bytes(paper_model, world_size, stage, precision=precision)
        formula = costmodel.model_state_bytes(PAPER_PSI, world_size, stage, "adam", precision)
        rows.append({"stage": stage, "paper_gb": PAPER_GB[stage] if world_size == PAPER_N else None,
                     "formula": formula["total"], "counted": counted["total"]})  # fmt: skip
    return rows


__all__ = ["PAPER_GB", "PAPER_N", "PAPER_PSI", "count_state_bytes", "expected_state_bytes", "paper_model",
           "paper_table"]  # fmt: skip
