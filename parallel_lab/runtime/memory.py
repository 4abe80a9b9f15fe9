"""Live memory by category: which tensors hold how many bytes, allocation by allocation.

The idea (the "memory anatomy" of training; ZeRO, Rajbhandari et al.
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
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from parallel_lab.runtime.alloc_mode import _AllocMode, storage_of  # noqa: E402,F401
from parallel_lab.runtime.trace import CATEGORIES


class MemoryTracker:
    """Live bytes per category (`trace.CATEGORIES`) on one device, with the peak.

    Only storages on `device` are counted (a CUDA tracker ignores host tensors such
    as Adam's CPU step counters), except what `register` is explicitly given.
    Use as `with MemoryTracker(device) as mem: ...` or `start()`/`stop()`;
    `parallel_lab.runtime.launch(..., track_memory=True)` attaches one per rank as `ctx.memory`.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._devices: dict[torch.device, bool] = {}  # storage device -> "is it ours", cached
        self._live: dict[int, list] = {}  # storage address -> [nbytes, category, weakref]
        self._by_cat: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak_total = 0
        self._peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._high_water = 0  # highest total since the last `take_high_water()`
        self._local = (
            threading.local()
        )  # category() labels are per thread: a comm thread must not relabel compute
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
    def _label_stack(self) -> list[str]:
        stack = getattr(self._local, "labels", None)
        if stack is None:
            stack = self._local.labels = []
        return stack

    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Label allocations made inside the block (e.g. `with mem.category("comm"): buf = ...`)."""
        if name not in CATEGORIES:
            raise ValueError(f"category name must be one of {CATEGORIES}, got {name!r}")
        self._label_stack().append(name)
        try:
            yield
        finally:
            self._label_stack().pop()

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
        labels = self._label_stack()
        if labels:
            cat = labels[-1]
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
            if self._total > self._high_water:
                self._high_water = self._total
            if self._total > self._peak_total:
                self._peak_total = self._total
                self._peak = dict(self._by_cat)
            if self._pending:
                self._drain()

    def _resized(self, t: torch.Tensor) -> None:
        st = storage_of(t)
        entry = None if st is None else self._live.get(st._cdata)
        if entry is None or entry[2]() is not st:
            return  # a storage from before start(): not ours to count
        with self._lock:
            grow = st.nbytes() - entry[0]
            if grow:
                entry[0] += grow
                self._by_cat[entry[1]] += grow
                self._total += grow
                if self._total > self._high_water:
                    self._high_water = self._total
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
        st = storage_of(t)
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

    def take_high_water(self) -> int:
        """The highest total since the previous call (or start), then start a new window from
        now: what a sample taken now cannot see, the temporaries that came and went since."""
        with self._lock:
            self._drain()
            hw, self._high_water = max(self._high_water, self._total), self._total
            return hw

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

    def cross_check(self, snapshot: dict[str, int] | None = None) -> dict[str, int] | None:
        """On CUDA: the tracker's count beside the caching allocator's; None on CPU.

        `tracked` counts logical storage bytes; `allocated` is the allocator's (rounded to
        its 512-byte blocks, plus tensors made before `start()` and never registered, plus
        library workspaces), so `tracked <= allocated` holds on a correct tracker and
        `untracked` says how much the categories do not explain. `reserved` adds what the
        allocator caches for reuse: the number `nvidia-smi` shows.
        """
        from parallel_lab.runtime import device as mesh

        stats = mesh.device_memory_stats(self.device)
        if stats is None:
            return None
        tracked = sum((snapshot if snapshot is not None else self.snapshot()).values())
        return {"tracked": tracked, **stats, "untracked": stats["allocated"] - tracked}


__all__ = ["MemoryTracker"]
