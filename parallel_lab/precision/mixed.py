"""Mixed precision: 16-bit compute, fp32 master weights, dynamic loss scaling.

Micikevicius et al. 2018, "Mixed Precision Training": weights, activations and
gradients in fp16; the optimizer keeps an fp32 *master* copy of the weights and
adds each update there (an update lr * grad below fp16's ~6e-5 is lost
in fp16, and one below half a unit in the last place of the weight vanishes when
added to it); the loss is multiplied by a scale S before backward so small
gradients stay above fp16's underflow, and the gradients are divided by S again in
fp32. Dynamic scaling (the rule of `torch.amp.GradScaler`): a step whose gradients
hold an inf/NaN is skipped and S is multiplied by `backoff_factor`; after
`growth_interval` clean steps in a row S is multiplied by `growth_factor`.
bf16 has fp32's exponent range, so it trains without a scaler (Kalamkar et al. 2019).

Invariant: every rank decides the same thing. The overflow flag is all-reduced
(max) through `comms` before anyone steps, so an inf on one rank makes every rank
skip the same step and keep the same scale, and replicas never drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.models import make_optimizer
from parallel_lab.precision.formats import resolve_dtype


#: The dtypes a lesson names, by the name it uses.
def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when any tensor holds an inf or a NaN."""
    flags = [~torch.isfinite(t).all() for t in tensors if t is not None]
    return bool(torch.stack(flags).any()) if flags else False


# ----------------------------------------------------------------------------- the dynamic loss scale
def update_scale(
    scale: float, growth_tracker: int, found_inf: bool, growth_factor: float = 2.0,
    backoff_factor: float = 0.5, growth_interval: int = 2000,
) -> tuple[float, int]:  # fmt: skip
    """One step of the dynamic loss-scale rule; returns (new scale, new count of clean steps).

    Overflow: scale * backoff, count back to 0. Clean: count + 1; when it reaches
    `growth_interval`, scale * growth (if that stays finite in fp32) and the count
    restarts. The scale is an fp32 number, as in GradScaler.
    """
    if found_inf:
        return _f32(scale * backoff_factor), 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = _f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


def _f32(x: float) -> float:
    """Round to fp32, where GradScaler keeps its scale."""
    return torch.tensor(x, dtype=torch.float32).item()


class LossScaler:
    """Dynamic loss scaling with GradScaler's rule and API (`scale`, `unscale_`, `step`, `update`).

    Differences that are the lesson: `unscale_`/`step` take the launch `ctx` and
    all-reduce the overflow flag through `comms`, so every rank skips together; and
    `history` keeps (scale, found_inf) per step for the plot.
    """

    def __init__(
        self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
        growth_interval: int = 2000, enabled: bool = True, dynamic: bool = True,
    ) -> None:  # fmt: skip
        for name, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if init_scale <= 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.enabled, self.dynamic = enabled, dynamic
        self.loss_scale = _f32(float(init_scale)) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self.growth_tracker = 0
        self.history: list[dict[str, Any]] = []
        self._found_inf: bool | None = None  # this iteration's verdict, once unscaled

    def get_scale(self) -> float:
        return self.loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S, in fp32 (a 16-bit loss times 2^16 would overflow by itself)."""
        return loss.float() * self.loss_scale if self.enabled else loss

    def unscale_(self, grads: Iterable[torch.Tensor | None], ctx: Any = None, group: Any = None) -> bool:
        """Divide `grads` by S in place; return whether ANY rank found an inf/NaN.

        The local flag is one float; with `ctx` on several ranks it is all-reduced
        (max) so every rank gets the same answer (4 bytes on the wire)."""
        grads = [g for g in grads if g is not None]
        if not self.enabled:
            self._found_inf = False
            return False
        inv = 1.0 / self.loss_scale
        # (1,) on the rank's device even with no gradients here: NCCL reduces device tensors only
        device = grads[0].device if grads else (ctx.device if ctx is not None else "cpu")
        flag = torch.zeros(1, device=device)
        for g in grads:
            flag = torch.maximum(flag, (~torch.isfinite(g).all()).float())  # (1,): no sync per tensor
            g.mul_(inv)
        if ctx is not None and ctx.world_size > 1:
            comms.dist_all_reduce(ctx, flag, op="max", group=group)
        self._found_inf = bool(flag.item())
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer, ctx: Any = None, group: Any = None) -> bool:
        """Unscale the optimizer's gradients (unless `unscale_` ran already), then step unless any
        rank overflowed. Returns True when the step ran."""
        if self._found_inf is None:
            params = [p for grp in optimizer.param_groups for p in grp["params"]]
            self.unscale_([p.grad for p in params], ctx, group)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self, found_inf: bool | None = None) -> float:
        """Apply the rule for this iteration (its verdict from `unscale_`/`step`, or `found_inf`)."""
        found = self._found_inf if found_inf is None else bool(found_inf)
        if found is None:
            raise RuntimeError("update() before unscale_()/step() in this iteration: pass found_inf")
        self.history.append({"scale": self.loss_scale, "found_inf": found})
        if self.enabled and self.dynamic:
            self.loss_scale, self.growth_tracker = update_scale(
                self.loss_scale, self.growth_tracker, found, self.growth_factor, self.backoff_factor,
                self.growth_interval,
            )  # fmt: skip
        self._found_inf = None
        return self.loss_scale

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, so a scaler's state moves between the two."""
        return {"scale": self.loss_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self.growth_tracker = state["growth_interval"], state["_growth_tracker"]


# ----------------------------------------------------------------------------- master weights
@dataclass
class MixedPrecisionConfig:
    """Which recipe: dtype of weights/compute, fp32 master copy, loss scaling."""

    dtype: str = "fp16"  # "fp32", "fp16" or "bf16"
    master_weights: bool = True
    loss_scale: str | float = "dynamic"  # "dynamic", "none", or a fixed number
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        ls = self.loss_scale
        if not (
            ls in ("dynamic", "none")
            or (isinstance(ls, (int, float)) and not isinstance(ls, bool) and ls > 0)
        ):
            raise ValueError(f"loss_scale must be 'dynamic', 'none' or a number > 0, got {ls!r}")

    def scaler(self) -> LossScaler:
        if self.loss_scale == "none":
            return LossScaler(enabled=False)
        fixed = self.loss_scale != "dynamic"
        return LossScaler(float(self.loss_scale) if fixed else self.init_scale, self.growth_factor,
                          self.backoff_factor, self.growth_interval, dynamic=not fixed)  # fmt: skip


class MixedPrecisionOptimizer:
    """A 16-bit model, its fp32 master weights, an optimizer on the masters, and a `LossScaler`.

    `model` is cast to `config.dtype` in place. Per step: `backward(loss)` (scaled),
    then `step()`: fp32 gradients = 16-bit gradients / S; overflow flag agreed by all
    ranks; on overflow skip, else average the fp32 gradients over the ranks (data
    parallel), step the masters, and round them back into the model.
    """

    def __init__(
        self, model: nn.Module, optimizer: str = "adam", lr: float = 1e-3,
        config: MixedPrecisionConfig | None = None, ctx: Any = None,
    ) -> None:  # fmt: skip
        self.config = config or MixedPrecisionConfig()
        self.ctx = ctx
        self.dtype = resolve_dtype(self.config.dtype)
        self.model = model.to(self.dtype)
        self.params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))  # tied: once
        use_masters = self.config.master_weights and self.dtype != torch.float32
        self.masters = (
            [p.detach().float().clone().requires_grad_() for p in self.params] if use_masters else None
        )
        self.optimizer = make_optimizer(optimizer, self.masters or self.params, lr)
        self.scaler = self.config.scaler()
        if ctx is not None and ctx.memory is not None:
            ctx.memory.register_module(model)
            ctx.memory.register_optimizer(self.optimizer)
            for m in self.masters or []:
                ctx.memory.register(m, "optim")  # ZeRO's accounting: the master copy is optimizer state

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def _span(self, name: str, kind: str):
        import contextlib

        return self.ctx.span(name, kind) if self.ctx is not None else contextlib.nullcontext()

    def step(self) -> bool:
        """Returns True when the step ran, False when every rank skipped it (overflow somewhere)."""
        ctx = self.ctx
        with self._span("unscale", "compute"):
            if self.masters is not None:
                for p, m in zip(self.params, self.masters):
                    m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)  # fp32 copy
                grads = [m.grad for m in self.masters]
            else:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
                for p, g in zip(self.params, grads):
                    p.grad = g
        found_inf = self.scaler.unscale_(grads, ctx)  # the flag is all-reduced inside
        if not found_inf:
            if ctx is not None and ctx.world_size > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])  # (N,): one all-reduce, not one per tensor
                comms.dist_all_reduce(ctx, flat, op="sum")
                flat /= ctx.world_size  # average: the same update as one big batch
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            with self._span("optimizer step", "optimizer"):
                self.optimizer.step()
                if self.masters is not None:
                    with torch.no_grad():
                        for p, m in zip(self.params, self.masters):
                            p.copy_(m)  # round the fp32 master into the 16-bit weight
        if self.masters is not None:
            for m in self.masters:
                m.grad = None  # fp32 gradients are transient; the 16-bit ones stay until zero_grad
        self.scaler.update(found_inf)
        return not found_inf


__all__ = [
    "LossScaler",
    "MixedPrecisionConfig",
    "MixedPrecisionOptimizer",
    "has_overflow",
    "update_scale",
]
