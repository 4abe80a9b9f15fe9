"""Live memory by category: which tensors hold how many bytes, allocation by allocation.

The idea (the "memory anatomy" of training, seed 003; ZeRO, Rajbhandari et al.
2020, §3): a rank's memory is parameters, gradients, optimizer states,
activations, communication buffers and temporaries. `MemoryTracker` measures each
of these live, on any device, CPU included:

- a `TorchDispatchMode` sees the output tensors of every aten op; each new
  *untyped storage* is counted once (views share their storage, so they never
  double count), keyed by the storage's C++ address;
- a weakref callback on the storage's Python object fires when the storage is
  freed (torch keeps one Python object alive per storage for as long as the storage
  lives), and its bytes are subtracted, so peaks include temporaries.

Labels. An allocation takes, in order: the innermost `tracker.category(name)`
block; else "activation" inside autograd backward or when grad mode is on (the
forward of a training step, its inputs and the gradients flowing back); else
"other" (no-grad code: optimizer temporaries, evaluation, initialisation).
Registration then relabels what it knows: `register_module` -> "param" for its
parameters and "grad" for their `.grad` (as soon as each gradient is accumulated),
`register_optimizer` -> "optim" for per-parameter optimizer state after each step
(0-d bookkeeping like Adam's step counter stays "other": the bytes-per-parameter
accounting of `costmodel` leaves it out). Tensors that existed before `start()` are
only seen through registration. Tensors made from Python data (`torch.tensor`) are
seen through `aten.lift_fresh`.

Invariant: `snapshot()` sums to the bytes of live storages the tracker knows;
every such storage is counted once, under one category.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .trace import CATEGORIES

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def _storage(t: torch.Tensor):
    """The tensor's untyped storage, or None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_FRESH, _ALIAS, _RESIZE = 0, 1, 2  # what an op's outputs are, from its schema


def _op_kind(func: Any) -> int:
    """aten ops declare aliasing in their schema (views, in-place, out=): only
    un-annotated returns are new storages. In-place resizes and out= variants may
    grow an existing storage. Other namespaces (c10d...) hand back their inputs
    without annotations, so their outputs are never new."""
    if func is _LIFT_FRESH:  # torch.tensor(data): made outside the dispatcher, seen here first
        return _FRESH
    if func.namespace != "aten":
        return _ALIAS
    if not any(r.alias_info is not None for r in func._schema.returns):
        return _FRESH
    name = func._schema.name
    if name.endswith(("resize_", "resize_as_")) or name == "aten::set_" or "out" in func._overloadname:
        return _RESIZE
    return _ALIAS


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's output (a tensor, or a tuple/list, nested one level)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o
            elif isinstance(o, (tuple, list)):
                yield from (x for x in o if isinstance(x, torch.Tensor))


class _AllocMode(TorchDispatchMode):
    """Sees every op's outputs and hands fresh (or resized) storages to the tracker."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker
        self.kind: dict[Any, int] = {}  # op -> _FRESH / _ALIAS / _RESIZE, cached

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self.kind.get(func)
        if kind is None:
            kind = self.kind[func] = _op_kind(func)
        if kind == _FRESH:
            if type(out) is torch.Tensor:  # the common case, without a generator
                self.tracker._seen(out)
            else:
                for t in _tensors(out):
                    self.tracker._seen(t)
        elif kind == _RESIZE:
            for t in _tensors(out):
                self.tracker._resized(t)
        return out


class MemoryTracker:
    """Live bytes per category (`trace.CATEGORIES`) on one device, with the peak.

    Only storages on `device` are counted (a CUDA tracker ignores host tensors such
    as Adam's CPU step counters), except what `register` is explicitly given.
    Use as `with MemoryTracker(device) as mem: ...` or `start()`/`stop()`;
    `parallel_lab.launch(..., track_memory=True)` attaches one per rank as `ctx.memory`.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._devices: dict[torch.device, bool] = {}  # storage device -> "is it ours", cached
        self._live: dict[int, list] = {}  # storage address -> [nbytes, category, weakref]
        self._by_cat: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak_total = 0
        self._peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._labels: list[str] = []
        self._modules: list[weakref.ref] = []
        self._optimizers: list[weakref.ref] = []
        self._handles: list[Any] = []
        self._mode: _AllocMode | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Any]] = []  # frees seen while the lock was held

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> MemoryTracker:
        """Begin seeing allocations (on this thread and the autograd threads it starts)."""
        if self._mode is not None:
            raise RuntimeError("MemoryTracker.start() called twice without stop()")
        self._mode = _AllocMode(self)
        self._mode.__enter__()
        return self

    def stop(self) -> None:
        """Stop seeing new allocations and drop registration hooks; frees of known storages still count."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self.remove_hooks()  # a stopped tracker must not keep relabelling (or stay alive via hooks)

    def __enter__(self) -> MemoryTracker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def active(self) -> bool:
        return self._mode is not None

    # -- labels ----------------------------------------------------------------
    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Label allocations made inside the block (e.g. `with mem.category("comm"): buf = ...`)."""
        if name not in CATEGORIES:
            raise ValueError(f"category name must be one of {CATEGORIES}, got {name!r}")
        self._labels.append(name)
        try:
            yield
        finally:
            self._labels.pop()

    # -- bookkeeping (called per new storage: keep it lean) ---------------------
    def _seen(self, t: torch.Tensor) -> None:
        # Called for every op output: helpers are inlined, it is the hot path.
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # no storage (sparse, nested)
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None and entry[2]() is st:
            return  # already counted (an op that returned its input unannotated)
        dev = st.device
        mine = self._devices.get(dev)
        if not (self._mine(dev) if mine is None else mine):
            return
        if self._labels:
            cat = self._labels[-1]
        elif torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            cat = "activation"
        else:
            cat = "other"
        # Zero-byte storages are kept too: `torch.empty(0)` later grown by an out= op.
        self._add(st, key, st.nbytes(), cat)

    def _mine(self, dev: torch.device) -> bool:
        ok = self._devices.get(dev)
        if ok is None:
            want = self.device
            ok = self._devices[dev] = dev.type == want.type and (
                want.index is None or dev.index == want.index
            )
        return ok

    def _add(self, st: Any, key: int, nbytes: int, cat: str) -> None:
        ref = weakref.ref(st, lambda r, k=key: self._freed(k, r))
        with self._lock:
            if self._pending:
                self._drain()  # a dead storage at this address must go before the new one
            old = self._live.get(key)
            if old is not None:  # stale entry whose free we never heard of: drop it
                self._by_cat[old[1]] -= old[0]
                self._total -= old[0]
            self._live[key] = [nbytes, cat, ref]
            self._by_cat[cat] += nbytes
            self._total += nbytes
            if self._total > self._peak_total:
                self._peak_total = self._total
                self._peak = dict(self._by_cat)
            if self._pending:
                self._drain()

    def _resized(self, t: torch.Tensor) -> None:
        st = _storage(t)
        entry = None if st is None else self._live.get(st._cdata)
        if entry is None or entry[2]() is not st:
            return  # a storage from before start(): not ours to count
        with self._lock:
            grow = st.nbytes() - entry[0]
            if grow:
                entry[0] += grow
                self._by_cat[entry[1]] += grow
                self._total += grow
                if self._total > self._peak_total:
                    self._peak_total = self._total
                    self._peak = dict(self._by_cat)

    def _freed(self, key: int, ref: Any) -> None:
        # Runs when a storage dies, possibly on another thread or in the middle of
        # our own bookkeeping (a free triggered by an allocation): queue it, and
        # apply it now only if nobody holds the lock (the holder drains the queue).
        self._pending.append((key, ref))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            key, ref = self._pending.pop()
            entry = self._live.get(key)
            if entry is not None and entry[2] is ref:  # not a newer storage at a reused address
                del self._live[key]
                self._by_cat[entry[1]] -= entry[0]
                self._total -= entry[0]

    def _relabel(self, t: torch.Tensor, cat: str, force: bool = False) -> None:
        st = _storage(t)
        if st is None:
            return
        key = st._cdata
        entry = self._live.get(key)
        if entry is None or entry[2]() is not st:
            if force or self._mine(st.device):
                self._add(st, key, st.nbytes(), cat)
            return
        with self._lock:
            if entry[1] != cat:
                self._by_cat[entry[1]] -= entry[0]
                self._by_cat[cat] += entry[0]
                entry[1] = cat
            if self._pending:
                self._drain()

    # -- registration ----------------------------------------------------------
    def register(self, tensor: torch.Tensor, category: str) -> torch.Tensor:
        """Count `tensor`'s storage under `category` (also tensors created before `start()`)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        self._relabel(tensor, category, force=True)
        return tensor

    def register_module(self, module: nn.Module) -> nn.Module:
        """Parameters -> "param" (buffers -> "other"); each `.grad` -> "grad" once accumulated."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self._modules.append(weakref.ref(module))
        for p in module.parameters():
            self._relabel(p, "param")
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for b in module.buffers():
            self._relabel(b, "other")
        return module

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._relabel(p.grad, "grad")

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Its per-parameter state -> "optim", refreshed after every `step()`."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._optimizers.append(weakref.ref(optimizer))
        self._handles.append(optimizer.register_step_post_hook(lambda opt, a, k: self._scan_optimizer(opt)))
        self._scan_optimizer(optimizer)
        return optimizer

    def _scan_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    self._relabel(v, "optim")

    def _rescan(self) -> None:
        # Code may swap p.data or set p.grad by hand (DDP buckets, ZeRO shards): refresh.
        for ref in self._modules:
            m = ref()
            if m is not None:
                for p in m.parameters():
                    self._relabel(p, "param")
                    if p.grad is not None:
                        self._relabel(p.grad, "grad")
        for ref in self._optimizers:
            opt = ref()
            if opt is not None:
                self._scan_optimizer(opt)

    def remove_hooks(self) -> None:
        """Drop the gradient/optimizer hooks registration installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- reading -----------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        """Live bytes now, one entry per category in `trace.CATEGORIES`."""
        self._rescan()
        with self._lock:
            self._drain()
            return dict(self._by_cat)

    def total(self) -> int:
        """Live bytes now, all categories."""
        return sum(self.snapshot().values())

    def peak(self) -> dict[str, int]:
        """Bytes per category at the moment the total was highest since start / `reset_peak()`."""
        with self._lock:
            self._drain()
            return dict(self._peak)

    def reset_peak(self) -> None:
        """Start a new peak window from what is live now."""
        snap = self.snapshot()
        with self._lock:
            self._peak, self._peak_total = snap, sum(snap.values())

    def largest(self, n: int = 10) -> list[tuple[str, int]]:
        """The `n` largest live storages as (category, bytes): where a peak comes from."""
        with self._lock:
            self._drain()
            return sorted(((e[1], e[0]) for e in self._live.values()), key=lambda x: -x[1])[:n]

    def sample(self, recorder: Any, label: str = "") -> dict | None:
        """Record one memory sample of this tracker into `recorder` (a `trace.Recorder`)."""
        prev, recorder.memory = recorder.memory, self
        try:
            return recorder.sample_memory(label)
        finally:
            recorder.memory = prev

    def cross_check(self) -> dict[str, int] | None:
        """On CUDA: tracked total vs the allocator's count; None where there is no such count.

        `untracked` is what the device holds that the tracker never saw (tensors
        made before `start()` and not registered, library workspaces).
        """
        try:
            from . import mesh
        except ImportError:
            return None
        fn = getattr(mesh, "device_memory_allocated", None)
        dev = fn(self.device) if fn is not None else None
        if dev is None:
            return None
        tracked = self.total()
        return {"tracked": tracked, "device": int(dev), "untracked": int(dev) - tracked}


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
        st = _storage(t)
        if st is not None:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


# -- model states: one real optimizer step, counted -------------------------------
_DTYPES = {"fp32": torch.float32, "mixed": torch.float16, "bf16": torch.bfloat16}
_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


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
        from .models import make_optimizer

        self.model = model.to(_DTYPES[precision])
        self.params = [p for p in model.parameters() if p.requires_grad]  # unique, tied counted once
        self.masters = None
        if precision == "mixed":
            self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = make_optimizer(optimizer_name, self.masters or self.params, lr)

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


def _meta_copy(model: nn.Module) -> nn.Module:
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
        model = _meta_copy(model)
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

    from .models import compute_loss

    _check_state_args(optimizer_name, precision)
    model = copy.deepcopy(model)
    x, y = batch
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


__all__ = [
    "MemoryTracker",
    "attach_hooks",
    "count_bytes",
    "measure_model_state",
    "model_state_bytes_measured",
]
