"""Model-state bytes measured, not predicted: one real optimizer step, counted.

The same code runs on `meta` tensors (shapes and dtypes, no storage), so the bytes
of a 7B model's parameters, gradients and optimizer states per rank are counted
exactly without allocating them. Invariant: the counts come from tensors torch
really created, never from a formula (costmodel/formulas.py is the formula side).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from parallel_lab.runtime.alloc_mode import storage_of

if TYPE_CHECKING:  # runtime/memory.py re-exports this module, so import it lazily at run time
    from parallel_lab.runtime.memory import MemoryTracker


def attach_hooks(
    module: nn.Module,
    recorder: Any,
    optimizer: torch.optim.Optimizer | None = None,
    tracker: MemoryTracker | None = None,
) -> list[Any]:
    """Sample memory after each leaf submodule's forward and backward, and after `optimizer.step()`.

    Gives a training step's memory curve its detail. Samples go to `recorder` (its
    attached tracker, or `tracker`). Returns the hook handles (call `.remove()`).
    """
    mem = tracker if tracker is not None else getattr(recorder, "memory", None)
    if mem is None:
        raise ValueError("attach_hooks needs a tracker: pass tracker= or set recorder.memory")

    def take(label: str) -> None:
        mem.sample(recorder, label)

    def fwd_hook(name: str):
        def hook(mod, inputs, output):
            take(f"fwd:{name}")
            if isinstance(output, torch.Tensor) and output.requires_grad:
                # Fires when the gradient w.r.t. this output is ready: the start of
                # this module's backward. A tensor hook leaves the graph unchanged.
                output.register_hook(lambda g: take(f"bwd:{name}"))

        return hook

    handles = []
    for name, sub in module.named_modules():
        if name and not any(True for _ in sub.children()):
            handles.append(sub.register_forward_hook(fwd_hook(name)))
    if optimizer is not None:
        handles.append(optimizer.register_step_post_hook(lambda opt, a, k: take("optimizer.step")))
    return handles


def count_bytes(obj: nn.Module | torch.Tensor | Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers, or some tensors.

    Works on `meta` tensors (nothing allocated), so huge models can be counted.
    Tied weights and views are counted once.
    """
    if isinstance(obj, nn.Module):
        tensors: Iterable[torch.Tensor] = [*obj.parameters(), *obj.buffers()]
    elif isinstance(obj, torch.Tensor):
        tensors = [obj]
    else:
        tensors = obj
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"count_bytes takes a module or tensors, found {type(t).__name__}")
        st = storage_of(t)
        if st is not None:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


# -- model states: one real optimizer step, counted -------------------------------
_DTYPES = {"fp32": torch.float32, "mixed": torch.float16, "bf16": torch.bfloat16}
# Beyond make_optimizer's four: torch optimizers whose state lesson 02's exercise asks the learner to count.
_MORE_OPTIMIZERS = {
    "adagrad": lambda ps, lr: torch.optim.Adagrad(ps, lr=lr),
    "rmsprop": lambda ps, lr: torch.optim.RMSprop(ps, lr=lr),
    "rmsprop_momentum": lambda ps, lr: torch.optim.RMSprop(ps, lr=lr, momentum=0.9),
    "rmsprop_centered": lambda ps, lr: torch.optim.RMSprop(ps, lr=lr, momentum=0.9, centered=True),
    "adam_amsgrad": lambda ps, lr: torch.optim.Adam(ps, lr=lr, amsgrad=True),
    "adadelta": lambda ps, lr: torch.optim.Adadelta(ps, lr=lr),
}
_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", *_MORE_OPTIMIZERS)


def _check_state_args(optimizer_name: str, precision: str) -> None:
    if optimizer_name not in _OPTIMIZERS:
        raise ValueError(f"optimizer_name must be one of {_OPTIMIZERS}, got {optimizer_name!r}")
    if precision not in _DTYPES:
        raise ValueError(f"precision must be one of {tuple(_DTYPES)}, got {precision!r}")


class _Trainer:
    """A model cast to `precision` plus its optimizer. "mixed" keeps fp32 master
    copies (counted as optimizer state, as in the ZeRO paper's 16 bytes/param) and
    runs the optimizer on them; "fp32" and "bf16" step the model's own parameters."""

    def __init__(self, model: nn.Module, optimizer_name: str, precision: str, lr: float = 1e-3):
        from parallel_lab.models import make_optimizer

        self.model = model.to(_DTYPES[precision])
        self.params = [p for p in model.parameters() if p.requires_grad]  # unique, tied counted once
        self.masters = None
        if precision == "mixed":
            self.masters = [p.detach().float().requires_grad_() for p in self.params]
        stepped = self.masters or self.params
        if optimizer_name in _MORE_OPTIMIZERS:
            self.opt = _MORE_OPTIMIZERS[optimizer_name](stepped, lr)
        else:
            self.opt = make_optimizer(optimizer_name, stepped, lr)

    def step(self) -> None:
        if self.masters is None:
            self.opt.step()
            return
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()  # fp32 gradient, transient
            self.opt.step()
            for p, m in zip(self.params, self.masters):
                m.grad = None
                p.copy_(m)  # round the fp32 master back into the 16-bit weight

    def state_tensors(self) -> list[torch.Tensor]:
        out = list(self.masters or [])
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter and buffer on `meta` (ties kept, nothing allocated)."""
    import copy

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def model_state_bytes_measured(
    model: nn.Module | Any, optimizer_name: str = "adam", precision: str = "mixed"
) -> dict[str, int]:
    """Param/grad/optim bytes of a model after one real optimizer step, on `meta` tensors.

    `model` is a module (copied to meta) or a zero-argument callable that builds
    one (built under `torch.device("meta")`, so a 7B model costs no memory). The
    step is torch's own optimizer; gradients are zeros of each parameter's shape.
    Frozen parameters count as "param" only.
    """
    _check_state_args(optimizer_name, precision)
    if isinstance(model, nn.Module):
        model = meta_copy(model)
    elif callable(model):
        with torch.device("meta"):
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model() must return an nn.Module, got {type(model).__name__}")
    else:
        raise TypeError(f"model must be an nn.Module or a callable building one, got {type(model).__name__}")
    tr = _Trainer(model, optimizer_name, precision)
    for p in tr.params:
        p.grad = torch.zeros_like(p)
    tr.step()
    out = {
        "param": count_bytes(list(model.parameters())),
        "grad": count_bytes([p.grad for p in tr.params]),
        "optim": count_bytes(tr.state_tensors()),
    }
    out["total"] = sum(out.values())
    return out


def measure_model_state(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer_name: str = "adam",
    precision: str = "fp32", lr: float = 1e-3,
) -> dict[str, int]:  # fmt: skip
    """Run one real training step of a copy of `model` under a `MemoryTracker`.

    Returns live bytes per category after the step (activations freed, gradients
    kept), plus "total" and "peak" (the highest total during the step).
    """
    import copy

    from parallel_lab.models import compute_loss

    _check_state_args(optimizer_name, precision)
    model = copy.deepcopy(model)
    x, y = batch
    from parallel_lab.runtime.memory import MemoryTracker

    with MemoryTracker(x.device) as mem:
        tr = _Trainer(model, optimizer_name, precision, lr)
        mem.register_module(model)
        mem.register_optimizer(tr.opt)
        for m in tr.masters or []:
            mem.register(m, "optim")
        if x.is_floating_point():
            x = x.to(_DTYPES[precision])
        y = y.to(_DTYPES[precision]) if y.is_floating_point() else y
        mem.reset_peak()
        compute_loss(model, x, y).backward()
        tr.step()
        snap = mem.snapshot()
        snap["total"] = sum(snap.values())
        snap["peak"] = sum(mem.peak().values())
    mem.remove_hooks()
    return snap


__all__ = ["attach_hooks", "count_bytes", "measure_model_state", "meta_copy", "model_state_bytes_measured"]
