"""ZeRO-Offload: the fp32 master weights and the optimizer states live in host memory, the host runs Adam.

Ren, Rajbhandari, Aminabadi, Ruwase, Yang, Zhang, Li & He (2021), "ZeRO-Offload:
Democratizing Billion-Scale Model Training" (USENIX ATC).
On top of ZeRO stage 2 (`zero/optimizer.py`), per step and rank:

    device: forward + backward with the working weights; each layer's gradients are
            reduce-scattered as soon as they exist (ZeRO-2), and this rank's reduced piece
            goes straight to the host ("D2H", then dropped from the device)
    host:   Adam on this rank's (S,) fp32 master slice with its m and v
    device: the updated slice comes back ("H2D") and is all-gathered into the full weights

The device keeps only the working weights (2Ψ bytes in mixed precision, 4Ψ in fp32)
plus transient gradients; the host keeps 16S bytes: fp32 master, m, v, and the fp32
gradient slice it accumulates into. Transfers per step: S gradient elements down, S
weight elements up, in the working dtype.

On a CPU-only machine the device/host boundary is emulated and labelled so: "device"
tensors are counted by the launch's tracker (`ctx.memory`), "host" tensors are made and
updated inside `HostPool` sections, hidden from that tracker and counted by the pool's
own tracker; bytes are real, a transfer is a real copy (a span of kind "memcpy").

Invariant: the parameters after a step equal ZeRO-2's, i.e. single-process Adam on the
union of the ranks' batches up to summation order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from parallel_lab import costmodel
from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.memory import MemoryTracker, exclusive
from parallel_lab.runtime.trace import Recorder
from parallel_lab.zero import (
    GradReducer,
    ShardStates,
    ZeroBase,
    bind_params,
    check_precision,
    copy_range,
    ring_all_gather_,
)


class HostPool:
    """The emulated host: inside `with pool:` the device tracker is blind and this pool's tracker counts.

    `pool.tracker` holds host bytes by category; `pool.sample(label)` records a sample in
    `pool.recorder` (same clock as the rank's timeline, kept apart from device samples:
    plot `pool.samples` next to the run's memory). Sections nest (the inner one is a no-op).
    """

    def __init__(self, ctx, track: bool = True) -> None:
        self.ctx = ctx
        self.tracker = MemoryTracker("cpu") if track else None
        self.recorder = Recorder(rank=ctx.rank, t0=ctx.recorder.t0)
        self._depth = 0
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> HostPool:
        self._depth += 1
        if self._depth == 1:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(exclusive(self.tracker))  # the device tracker sees nothing here
            if self.tracker is not None:
                self.tracker.start()
                self._stack.callback(self.tracker.stop)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._stack is not None:
            self._stack.close()
            self._stack = None

    def register(self, t: torch.Tensor, category: str) -> torch.Tensor:
        if self.tracker is not None:
            self.tracker.register(t, category)
        return t

    def sample(self, label: str = "") -> None:
        if self.tracker is not None:
            self.tracker.sample(self.recorder, label)

    @property
    def samples(self) -> list[dict]:
        return self.recorder.samples


def offload_state_bytes(
    num_params: int, world_size: int = 1, precision: str = "mixed"
) -> dict[str, dict[str, int]]:
    """Bytes per rank on each side, ZeRO-Offload on ZeRO-2 with Adam (this module's accounting).

    device: working weights (2Ψ mixed, 4Ψ fp32; the flat buffer is padded to N·S elements);
    host: fp32 master + m + v + fp32 gradient slice, 4S each (S = ceil(Ψ/N)).
    """
    if precision not in ("fp32", "mixed"):
        raise ValueError(f"precision must be 'fp32' or 'mixed', got {precision!r}")
    s = costmodel.shard_numel(num_params, world_size)
    w = 4 if precision == "fp32" else 2
    device = {"param": w * s * world_size, "grad": 0, "optim": 0}
    host = {"param": 0, "grad": 4 * s, "optim": 12 * s}
    for d in (device, host):
        d["total"] = d["param"] + d["grad"] + d["optim"]
    return {"device": device, "host": host}


class ZeroOffload(ZeroBase):
    """ZeRO-2 with the optimizer on the host (see the module docstring).

    `zero = ZeroOffload(ctx, model, optimizer="adam", lr=1e-3)`, then `loss.backward();
    zero.step(); zero.zero_grad()`. `transfer_bytes` counts what crossed the boundary;
    `host` is the `HostPool` (pass one to share it).
    """

    def __init__(self, ctx, model: nn.Module, optimizer: Any = "adam", precision: str = "fp32",
                 units: list[nn.Module] | None = None, group=None, host: HostPool | None = None,
                 **optim_kwargs: Any) -> None:  # fmt: skip
        self.host = host if host is not None else HostPool(ctx)
        self.transfer_bytes = {"d2h": 0, "h2d": 0}
        super().__init__(ctx, model, 2, optimizer, precision, units, group, optim_kwargs)
        params = self.groups.flat
        bind_params(params, self.layout, self.states.flat)
        self._ptrs = [p.data_ptr() for p in params]
        self.reducer = GradReducer(ctx, self.groups.params, self.layout, self.states, self.rank, group,
                                   names=self.groups.names, sink=self._to_host)  # fmt: skip
        self._signature = self._model_signature()
        if ctx.memory is not None:
            ctx.memory.register_module(model)
            ctx.memory.register(self.states.flat, "param")
        self.host.sample("init")

    def _build_states(self, params: list[nn.Parameter], optim_kwargs: dict) -> ShardStates:
        work = check_precision(self.precision)
        lay, (lo, hi) = self.layout, self.layout.owned(self.rank)
        flat = torch.empty(lay.padded, dtype=work, device=self.device)  # (P,) device: working weights
        copy_range(params, lay, 0, lay.padded, flat)
        with self.host:
            self.master = torch.empty(lay.shard, dtype=torch.float32)  # (S,) host: fp32 master slice
            copy_range(params, lay, lo, hi, self.master)
            self.master.requires_grad_()
            self.host_grad = torch.zeros(lay.shard, dtype=torch.float32)  # (S,) host: fp32 gradient slice
            opt = self.optimizer_cls([self.master], **optim_kwargs)
            self.host.register(self.master, "optim")  # the master copy counts as optimizer state (ZeRO)
            self.host.register(self.host_grad, "grad")
            if self.host.tracker is not None:
                self.host.tracker.register_optimizer(opt)
        # The device keeps no gradient slice: reduced pieces go to the host at once.
        return ShardStates(2, flat, flat[lo:hi], None, None, None, opt)

    # -- the boundary --------------------------------------------------------------
    def _to_host(self, u: int, lo: int, hi: int, piece: torch.Tensor) -> None:
        """A reduced gradient piece crosses to the host (a copy into a staging buffer), where it is added."""
        nbytes = piece.numel() * piece.element_size()
        with self.host:
            with self.ctx.span("D2H grads", "memcpy", bytes=nbytes, unit=u):
                # page-locked on a GPU machine (a DMA copy at full link speed); the copy is synchronous:
                # the host adds the piece right after, so it must have landed
                staged = mesh.host_buffer(torch.empty(piece.shape, dtype=piece.dtype), piece.device)
                staged.copy_(piece)  # the transfer
            self.host_grad[lo:hi] += staged  # host compute: accumulate in fp32
            del staged
        self.transfer_bytes["d2h"] += nbytes
        self.host.sample(f"gradient piece {u} on host")

    @torch.no_grad()
    def step(self) -> None:
        """Host Adam on the fp32 master slice, the slice back to the device, all-gather."""
        self._check_model()
        st, shard = self.states, self.states.shard
        with self.host:
            with self.ctx.span("host Adam", "optimizer"):
                self.master.grad = self.host_grad / self.world_size  # (S,) averaged over ranks
                st.optimizer.step()
                self.master.grad = None
        self.host.sample("after host Adam")
        nbytes = shard.numel() * shard.element_size()
        with self.ctx.span("H2D weights", "memcpy", bytes=nbytes):
            shard.copy_(self.master)  # the transfer (rounded to the working dtype)
        self.transfer_bytes["h2d"] += nbytes
        ring_all_gather_(self.ctx, st.flat, self.group)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the host's gradient slice (the device keeps no gradients between steps)."""
        self.host_grad.zero_()
        for p in self.groups.flat:
            p.grad = None

    def _check_model(self) -> None:
        super()._check_model()
        for p, ptr in zip(self.groups.flat, self._ptrs):
            if p.data_ptr() != ptr:
                raise ValueError(
                    f"model: parameter {self._names.get(id(p), '?')!r} no longer reads the flat buffer "
                    "(its .data was replaced after wrapping)"
                )

    def state_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds on each side, counted from its tensors."""
        from parallel_lab.runtime.memory_state import count_bytes

        frozen = sum(p.numel() * p.element_size() for p in self.groups.frozen)
        device = {"param": count_bytes(self.states.flat) + frozen, "grad": 0, "optim": 0}
        states = [v for s in self.states.optimizer.state.values() for v in s.values() if v.dim() > 0]
        host = {"param": 0, "grad": count_bytes(self.host_grad), "optim": count_bytes([self.master, *states])}
        for d in (device, host):
            d["total"] = d["param"] + d["grad"] + d["optim"]
        return {"device": device, "host": host}


__all__ = ["HostPool", "ZeroOffload", "offload_state_bytes"]
