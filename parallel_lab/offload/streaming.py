"""BMInf-style inference: a model larger than the device's memory runs layer by layer, weights streamed in.

BMInf (Han et al. 2021, "BMInf: An Efficient Toolkit for Big Model Inference and Tuning"),
which runs a 10B-parameter model on a 6 GB GPU, keeps every weight in host memory and,
for each layer in turn, copies its weights to the device just before the layer runs and
drops them after, so the device needs the largest layer (two with prefetch) plus the
activations, never the whole model. The price is bandwidth: every forward pass moves all
the weights across the host-device link again.

`WeightStreamer(ctx, model, budget_bytes)` does this with forward hooks on each *unit*
(every child of an `nn.ModuleList`, and every other top-level child holding parameters:
embeddings, final norm, head). Each parameter has one host copy (tied weights once); a
unit's weights are copied into one fresh device buffer (a "memcpy" span, bytes counted),
its Parameters become views of it, and after the unit the buffer is dropped. With
`prefetch` the next unit's copy is issued before the current one computes
(`non_blocking`: on a GPU with pinned host memory it overlaps; here it is a copy).
Inference only: run it under `torch.no_grad()`.

On a CPU-only machine the device is emulated as in `offload/host_optimizer.py`: host copies live in a
`HostPool` section, invisible to the device tracker.

Budget. `budget_bytes` bounds everything on the device, weights and activations;
`reserve_bytes` is the room kept for the activations a unit makes while it computes. At
construction the largest unit plus the reserve must fit. The next unit is prefetched
only if the bytes live on the device (the tracker's count, or the CUDA allocator's) plus
its weights plus the reserve fit; otherwise it is loaded when it runs, and a unit that
cannot be loaded within the budget at all raises.

Invariant: the device never holds more than `budget_bytes` of tracked tensors while the
model runs, if the activations leave room (checked against the tracker's measured peak
in the tests); the output equals the unstreamed model's bit for bit.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn

from parallel_lab.offload.host_optimizer import HostPool
from parallel_lab.runtime import device as mesh


def streaming_units(model: nn.Module) -> list[nn.Module]:
    """The model's children in order, each ModuleList opened into its children; those with parameters.

    For the lab's GPT: wte, wpe, blocks.0, ..., ln_f, lm_head, which is the order they run in."""
    out = []
    for child in model.children():
        parts = list(child.children()) if isinstance(child, nn.ModuleList) else [child]
        out += [m for m in parts if any(True for _ in m.parameters())]
    return out


class WeightStreamer:
    """Stream `model`'s weights from the host unit by unit within `budget_bytes` of device memory."""

    def __init__(self, ctx, model: nn.Module, budget_bytes: int, units: list[nn.Module] | None = None,
                 prefetch: bool = True, reserve_bytes: int = 0, host: HostPool | None = None) -> None:  # fmt: skip
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be an int >= 0, got {reserve_bytes!r}")
        self.reserve = reserve_bytes
        self.ctx, self.model, self.prefetch = ctx, model, bool(prefetch)
        self.units = streaming_units(model) if units is None else list(units)
        if not self.units:
            raise ValueError("model has no units to stream (no parameters?)")
        self.device = next(model.parameters()).device
        if getattr(ctx, "device", None) is not None and self.device != torch.device(ctx.device):
            raise ValueError(
                f"model is on {self.device} but this rank computes on {ctx.device}: build it with "
                "device=ctx.device (the budget counts the bytes live on the rank's device, which would "
                "never see these weights)"
            )
        self.host = host if host is not None else HostPool(ctx)
        self.params = [list(dict.fromkeys(u.parameters())) for u in self.units]  # each unit's, once
        self.shapes = {id(p): p.shape for ps in self.params for p in ps}
        sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in self.params]
        if max(sizes) + reserve_bytes > budget_bytes:
            raise ValueError(
                f"budget_bytes={budget_bytes:,} is too small: the largest unit's weights need {max(sizes):,} bytes, "
                f"plus reserve_bytes={reserve_bytes:,} for activations"
            )
        self.budget, self.sizes = budget_bytes, sizes
        with self.host:  # one host copy per parameter (tied weights once); the device keeps nothing
            # pinned on a GPU machine: the copies below then run on their own stream, under compute
            self.host_copy = {id(p): self.host.register(mesh.host_buffer(p.detach().to("cpu", copy=True), self.device),
                                                        "param")
                              for ps in self.params for p in ps}  # fmt: skip
        self.workspace = mesh.gemm_workspace_bytes(self.device)  # 0 on a CPU
        self.copy_stream = mesh.side_stream(self.device)  # None on a CPU: copies run inline
        self.ready: list = [None] * len(self.units)  # per unit: where its copy ends on the copy stream
        self._placeholder = torch.empty(0, dtype=self.params[0][0].dtype, device=self.device)
        for ps in self.params:
            for p in ps:
                p.data = self._placeholder
        self.bufs: list[torch.Tensor | None] = [None] * len(self.units)
        self.h2d_bytes = 0
        self._hooks = []
        for u, m in enumerate(self.units):
            self._hooks.append(m.register_forward_pre_hook(partial(self._pre, u)))
            self._hooks.append(m.register_forward_hook(partial(self._post, u)))
        self.host.sample("host copies")

    def _load(self, u: int) -> None:
        """Copy unit u's weights host -> device into one fresh buffer; bind its Parameters as views."""
        if self.bufs[u] is not None:
            return
        ps = self.params[u]
        dtype = ps[0].dtype
        n = sum(self.shapes[id(p)].numel() for p in ps)
        mem = self.ctx.memory
        with mem.category("param") if mem is not None else contextlib.nullcontext():
            buf = torch.empty(n, dtype=dtype, device=self.device)  # (unit,) on the device
        off = 0
        allocated = mesh.stream_point(self.device)  # buf's memory may still be read by earlier kernels
        with mesh.on_stream(self.copy_stream):
            mesh.wait_for(allocated)
            # the span inside: on a GPU its marks go on the copy stream, so it shows when the copy ran
            with self.ctx.span(f"H2D {u}", "memcpy", bytes=self.sizes[u]):
                for p in ps:
                    k = self.shapes[id(p)].numel()
                    buf[off : off + k].copy_(self.host_copy[id(p)].reshape(-1), non_blocking=True)
                    off += k
            self.ready[u] = mesh.stream_point(self.device)
        self.bufs[u] = buf
        self.h2d_bytes += self.sizes[u]

    def _bind(self, u: int) -> None:
        off, buf = 0, self.bufs[u]
        mesh.wait_for(self.ready[u])  # GPU: compute on this unit starts after its copy lands
        self.ready[u] = None
        mesh.used_here(buf)
        for p in self.params[u]:
            shape = self.shapes[id(p)]
            p.data = buf[off : off + shape.numel()].view(shape)
            off += shape.numel()

    def _device_bytes(self) -> int | None:
        """Bytes live on the device now: the tracker's count, or the CUDA allocator's; None if unknown."""
        if self.ctx.memory is not None:
            return self.ctx.memory.total()
        live = mesh.device_memory_allocated(self.device)
        # the allocator also holds cuBLAS's workspace (32 MiB on an H100), which is no tensor's
        return None if live is None else live - self.workspace

    def _fits(self, u: int, reserve: int = 0) -> bool:
        live = self._device_bytes()
        return live is None or live + self.sizes[u] + reserve <= self.budget

    def _pre(self, u: int, module, args) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError("WeightStreamer runs inference only: call the model under torch.no_grad()")
        if self.bufs[u] is None and not self._fits(u):
            raise RuntimeError(
                f"device budget exceeded: {self._device_bytes():,} bytes live + unit {u}'s {self.sizes[u]:,} > "
                f"budget_bytes={self.budget:,} (activations too large for this budget?)"
            )
        self._load(u)
        self._bind(u)  # (a tied weight may still point at another unit's buffer: rebind)
        if self.prefetch and u + 1 < len(self.units) and self._fits(u + 1, self.reserve):
            self._load(u + 1)  # the next unit's copy, issued before this one computes, if it fits

    def _post(self, u: int, module, args, output) -> None:
        for p in self.params[u]:
            p.data = self._placeholder
        self.bufs[u] = None  # the device copy is gone
        self.ctx.recorder.sample_memory(f"dropped unit {u}")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


__all__ = ["WeightStreamer", "streaming_units"]
