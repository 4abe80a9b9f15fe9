"""Live memory by category: which tensors hold how many bytes, allocation by allocation.

The idea (the "memory anatomy" of training; ZeRO, Rajbhandari et al.
2020, §3): a rank's memory is parameters, gradients, optimizer states,
activations, communication buffers and temporaries. `MemoryTracker` measures each
of these live, on any device, CPU included, by one of two mechanisms that see the
same storages:

- "allocator" (CPU, the default there): torch's CPU allocator wrapped in C++
  (`alloc_hook.py`); every allocation is counted as it is handed out and every free
  as its deleter runs, on any thread, with no Python per op, so a tracked step of
  a small model costs about what an untracked one does;
- "dispatch" (any device; the fallback where no C++ compiler is found): a
  `TorchDispatchMode` sees the output tensors of every aten op; each new *untyped
  storage* is counted once (views share their storage, so they never double count),
  keyed by the storage's C++ address; a weakref callback on the storage's Python
  object fires when the storage is freed (torch keeps one Python object alive per
  storage for as long as the storage lives), and its bytes are subtracted. It costs
  a trip through Python per op.

Either way peaks include temporaries. The allocator also sees what no op returns:
buffers an op makes and frees inside itself (its peaks can be a little higher), the
0-d tensor autograd keeps for a Python number a tensor was multiplied by, the RNG
state a checkpoint saves. Everything else live between ops agrees.

Labels. An allocation takes, in order: the innermost `tracker.category(name)`
block; else "activation" inside autograd backward or when grad mode is on (the
forward of a training step, its inputs and the gradients flowing back); else
"other" (no-grad code: optimizer temporaries, evaluation, initialisation).
Registration then relabels what it knows: `register_module` -> "param" for its
parameters and "grad" for their `.grad` (as soon as each gradient is accumulated),
`register_optimizer` -> "optim" for per-parameter optimizer state after each step
(0-d bookkeeping like Adam's step counter stays "other": the bytes-per-parameter
accounting of `costmodel` leaves it out). Tensors that existed before `start()` are
only seen through registration. The dispatch mode sees tensors made from Python
data (`torch.tensor`) through `aten.lift_fresh`.

Invariant: `snapshot()` sums to the bytes of live storages the tracker knows;
every such storage is counted once, under one category.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from parallel_lab.runtime import alloc_hook
from parallel_lab.runtime.alloc_mode import _AllocMode, storage_of  # noqa: E402,F401
from parallel_lab.runtime.trace import CATEGORIES

_MECHANISMS = ("auto", "allocator", "dispatch")


def thread_trackers() -> list:
    """The trackers whose dispatch mode is on in this thread (how a tracker sees allocations on a GPU;
    the CPU's allocator hook sees every thread). Hand them to `seen_by` on another thread."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [m.tracker for m in _get_current_dispatch_mode_stack() if isinstance(m, _AllocMode)]


@contextlib.contextmanager
def seen_by(trackers: list) -> Iterator[None]:
    """Inside the block, this thread's new storages are seen by `trackers` (from `thread_trackers`)."""
    with contextlib.ExitStack() as stack:
        for tracker in trackers:
            stack.enter_context(_AllocMode(tracker))
        yield


class MemoryTracker:
    """Live bytes per category (`trace.CATEGORIES`) on one device, with the peak.

    Only storages on `device` are counted (a CUDA tracker ignores host tensors such
    as Adam's CPU step counters), except what `register` is explicitly given.
    Use as `with MemoryTracker(device) as mem: ...` or `start()`/`stop()`;
    `parallel_lab.runtime.launch(..., track_memory=True)` attaches one per rank as `ctx.memory`.
    `mechanism`: "auto" (the allocator hook on CPU where it builds, else the dispatch
    mode), "allocator" or "dispatch" (see the module docstring).
    """

    def __init__(self, device: torch.device | str | None = None, mechanism: str = "auto"):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if mechanism not in _MECHANISMS:
            raise ValueError(f"mechanism must be one of {_MECHANISMS}, got {mechanism!r}")
        lib = None
        if mechanism != "dispatch" and self.device.type == "cpu":
            lib = alloc_hook.load()
        if mechanism == "allocator" and lib is None:
            raise RuntimeError(
                "mechanism='allocator' needs a CPU tracker and a C++ compiler to build the "
                f"allocator hook (device is {self.device}); use mechanism='dispatch'"
            )
        self.mechanism = "allocator" if lib is not None else "dispatch"
        self._lib = lib
        self._id = lib.pl_new_state() if lib is not None else 0
        self._ext: dict[int, Any] = {}  # token -> weakref of a registered storage the hook cannot see die
        self._started = False
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
        self._elsewhere = 0  # storages seen on other devices (a tracker watching an idle device says so)

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> MemoryTracker:
        """Begin seeing allocations (on this thread and the autograd threads it starts)."""
        if self._started:
            raise RuntimeError("MemoryTracker.start() called twice without stop()")
        self._started = True
        if self._lib is not None:
            self._lib.pl_set_active(self._id, 1)
        else:
            self._mode = _AllocMode(self)
            self._mode.__enter__()
        return self

    def stop(self) -> None:
        """Stop seeing new allocations and drop registration hooks; frees of known storages still count."""
        self._started = False
        if self._lib is not None:
            self._lib.pl_set_active(self._id, 0)
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self.remove_hooks()  # a stopped tracker must not keep relabelling (or stay alive via hooks)
        if self._elsewhere and self._peak_total == 0 and not self._live:
            # e.g. a tracker on cuda:0 around work whose tensors were made on the CPU: its zeros
            # would read as "this step needs no memory", and a budget check on it never fires.
            others = sorted(str(d) for d, ours in self._devices.items() if not ours)
            warnings.warn(
                f"MemoryTracker({self.device}) saw no storage on {self.device}, but {self._elsewhere} on "
                f"{', '.join(others)}: the work ran on another device, so every reading here is 0; "
                "track the device the tensors are on (ctx.device in a rank)",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> MemoryTracker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is not None:
            lib.pl_set_active(self._id, 0)
            lib.pl_free_state(self._id)

    @property
    def active(self) -> bool:
        return self._started

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
        if self._lib is not None:
            self._lib.pl_push_label(self._id, CATEGORIES.index(name))
        try:
            yield
        finally:
            self._label_stack().pop()
            if self._lib is not None:
                self._lib.pl_pop_label(self._id)

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
            self._elsewhere += 1
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
        if self._lib is not None:
            self._relabel_hooked(st, cat, force)
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

    def _relabel_hooked(self, st: Any, cat: str, force: bool) -> None:
        ptr = st.data_ptr()
        if not ptr or not (force or self._mine(st.device)):
            return
        token = self._lib.pl_relabel(self._id, ptr, st.nbytes(), CATEGORIES.index(cat))
        if token:  # a storage the hook did not see made: Python hears of its death
            lib, sid, ext = self._lib, self._id, self._ext

            def gone(ref: Any, ptr: int = ptr, token: int = token) -> None:
                lib.pl_forget(sid, ptr, token)
                ext.pop(token, None)

            ext[token] = weakref.ref(st, gone)

    def _read(self) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """(live by category, by category at the peak, [total, peak total, high water]) from the hook."""
        n = alloc_hook.NCATS
        live, peak, tot = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)(), (ctypes.c_int64 * 3)()
        self._lib.pl_read(self._id, live, peak, tot)
        return dict(zip(CATEGORIES, live)), dict(zip(CATEGORIES, peak)), list(tot)

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
        if self._lib is not None:
            return self._read()[0]
        with self._lock:
            self._drain()
            return dict(self._by_cat)

    def total(self) -> int:
        """Live bytes now, all categories."""
        return sum(self.snapshot().values())

    def peak(self) -> dict[str, int]:
        """Bytes per category at the moment the total was highest since start / `reset_peak()`."""
        if self._lib is not None:
            return self._read()[1]
        with self._lock:
            self._drain()
            return dict(self._peak)

    def reset_peak(self) -> None:
        """Start a new peak window from what is live now."""
        snap = self.snapshot()
        if self._lib is not None:
            self._lib.pl_reset_peak(self._id)
            return
        with self._lock:
            self._peak, self._peak_total = snap, sum(snap.values())

    def take_high_water(self) -> int:
        """The highest total since the previous call (or start), then start a new window from
        now: what a sample taken now cannot see, the temporaries that came and went since."""
        if self._lib is not None:
            return self._lib.pl_take_high_water(self._id)
        with self._lock:
            self._drain()
            hw, self._high_water = max(self._high_water, self._total), self._total
            return hw

    def largest(self, n: int = 10) -> list[tuple[str, int]]:
        """The `n` largest live storages as (category, bytes): where a peak comes from."""
        if self._lib is not None:
            sizes, cats = (ctypes.c_int64 * n)(), (ctypes.c_int * n)()
            k = self._lib.pl_largest(self._id, n, sizes, cats)
            return [(CATEGORIES[cats[i]], sizes[i]) for i in range(k)]
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


@contextlib.contextmanager
def exclusive(tracker: MemoryTracker | None) -> Iterator[None]:
    """On this thread, inside the block, only `tracker` sees allocations (None: no tracker does).

    Every other tracker is blind here, whichever mechanism it uses: allocator hooks skip
    it, dispatch modes are switched off. Frees of storages a blind tracker holds still
    count. Offload's emulated host (`offload.HostPool`) is such a section.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    lib = alloc_hook.load()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        if lib is not None:
            lib.pl_push_only(tracker._id if tracker is not None and tracker._lib is not None else 0)
            stack.callback(lib.pl_pop_only)
        yield


__all__ = ["MemoryTracker", "exclusive"]
