"""Big-model inference on a small device: int8 weights, streamed layer by layer (BMInf).

BMInf (Han et al. 2021, OpenBMB) runs a 10B-parameter model on a 6 GB
GPU with two ideas: linear-layer weights in int8 (1 byte per parameter instead of
2 or 4), and the model kept in host memory, with as many layers resident on the
device as fit and the rest copied in layer by layer, just in time, while the
previous layer computes.

`plan_layer_offload` is that plan on paper (the calculator); `run_layer_by_layer`
executes it on a scaled-down model and measures the device bytes.

Invariant: with `resident` layers kept on the device and at most `buffers`
streamed layers alive at once, the device holds at most
(resident + buffers) x layer bytes of weights plus the workspace of one layer;
the run records that peak so the budget is measured, not assumed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel_lab.runtime import device as mesh

#: bytes per parameter of each storage format (int4: two weights per byte).
DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def bytes_per_param(dtype: str) -> float:
    """Bytes one parameter takes when stored as `dtype` ("fp32", "fp16", "bf16", "int8", "int4")."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class OffloadPlan:
    """How a model of `layers` equal layers runs within `budget_bytes` of device memory."""

    layer_bytes: int  # one layer's weights in the chosen format
    model_bytes: int  # all layers
    budget_bytes: int
    workspace_bytes: int  # activations and temporaries of the layer being computed
    buffers: int  # staging slots for streamed layers (2: load the next while computing this one)
    resident: int  # layers kept on the device for the whole run
    streamed: int  # layers copied in for every forward pass
    fits: bool  # the plan respects the budget (at least the staging slots fit)

    @property
    def peak_bytes(self) -> int:
        """Device bytes the plan predicts at its worst moment."""
        slots = min(self.buffers, self.streamed)
        return (self.resident + slots) * self.layer_bytes + self.workspace_bytes

    @property
    def transfer_bytes(self) -> int:
        """Host-to-device bytes per forward pass (every streamed layer, once)."""
        return self.streamed * self.layer_bytes


def layer_bytes_of(num_params: float, layers: int, dtype: str = "int8") -> int:
    """Bytes of one of `layers` equal layers sharing `num_params` parameters stored as `dtype`."""
    _check_count("layers", layers)
    _check_positive("num_params", num_params)
    return math.ceil(num_params / layers * bytes_per_param(dtype))


def _check_count(name: str, v, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")


def _check_positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
        raise ValueError(f"{name} must be a positive number, got {v!r}")


def plan_layer_offload(
    layer_bytes: float, layers: int, budget_bytes: float, workspace_bytes: float = 0, buffers: int = 2
) -> OffloadPlan:
    """Keep as many of `layers` layers of `layer_bytes` each resident as fit in `budget_bytes`
    beside `buffers` staging slots and the `workspace_bytes` of one layer's activations."""
    _check_positive("layer_bytes", layer_bytes)
    _check_count("layers", layers)
    _check_positive("budget_bytes", budget_bytes)
    _check_count("buffers", buffers)
    if (
        isinstance(workspace_bytes, bool)
        or not isinstance(workspace_bytes, (int, float))
        or workspace_bytes < 0
    ):
        raise ValueError(f"workspace_bytes must be a number >= 0, got {workspace_bytes!r}")
    layer, budget, work = math.ceil(layer_bytes), int(budget_bytes), math.ceil(workspace_bytes)
    if layers * layer + work <= budget:  # everything fits: nothing to stream
        resident = layers
    else:
        resident = max(0, min(layers - 1, (budget - work - buffers * layer) // layer))
    streamed = layers - resident
    fits = (resident + min(buffers, streamed)) * layer + work <= budget
    return OffloadPlan(layer, layers * layer, budget, work, buffers, resident, streamed, fits)


def _to_device(
    ctx, name: str, host: dict[str, torch.Tensor], stream
) -> tuple[dict[str, torch.Tensor], object]:
    """A fresh device copy of a layer's weights (always a copy, also when host is device), made on
    `stream` (a GPU's copy stream; None: inline) inside the span `name`, whose marks go on that
    stream too, and the point where the copies end. From pinned host memory a copy on its own
    stream runs while the compute stream computes; from pageable memory it could not."""
    allocated = mesh.stream_point(ctx.device)  # the copies' memory may still be read by earlier kernels
    nbytes = sum(t.nbytes for t in host.values())
    with mesh.on_stream(stream):
        mesh.wait_for(allocated)
        with ctx.span(name, "memcpy", bytes=nbytes), _category(ctx, "param"):
            out = {k: v.to(ctx.device, copy=True, non_blocking=True) for k, v in host.items()}
        return out, mesh.stream_point(ctx.device)


def _category(ctx, name: str):
    """Label device allocations for the memory plot when the run tracks memory."""
    return ctx.memory.category(name) if getattr(ctx, "memory", None) is not None else contextlib.nullcontext()


def run_layer_by_layer(
    ctx, host_layers: list[nn.Module], x: torch.Tensor, resident: int, buffers: int = 2
) -> torch.Tensor:
    """Run `x` through `host_layers` (kept in host memory) on `ctx.device`.

    The first `resident` layers are copied to the device once and stay; every other
    layer is copied in just before it is needed and freed right after, with up to
    `buffers` streamed layers alive at once (the next one is loaded before the
    current one computes: on a GPU that copy overlaps the compute). Spans: "load i"
    (memcpy) and "layer i" (compute); with `ctx.memory` the peak is measured.
    """
    if not 0 <= resident <= len(host_layers):
        raise ValueError(f"resident must be in [0, {len(host_layers)}], got {resident}")
    _check_count("buffers", buffers)
    from torch.func import functional_call

    loaded: dict[int, dict[str, torch.Tensor]] = {}
    ready: dict[int, object] = {}  # where layer i's copies end on the copy stream (GPU)
    copy_stream = mesh.side_stream(ctx.device)  # None on a CPU: copies run inline
    # page-locked once on a GPU (as offload's weight streaming does), so the copies can overlap compute
    host = [
        {k: mesh.host_buffer(v.detach(), ctx.device) for k, v in layer.state_dict().items()}
        for layer in host_layers
    ]

    def load(i: int) -> None:
        if i < len(host_layers) and i not in loaded:
            loaded[i], ready[i] = _to_device(ctx, f"load {i}", host[i], copy_stream)

    for i in range(resident):
        load(i)
    h = x.to(ctx.device)  # (B, T, C)
    with torch.no_grad():
        for i, layer in enumerate(host_layers):
            for j in range(i, min(i + buffers, len(host_layers))):  # fill the staging slots
                load(j)
            mesh.wait_for(ready.pop(i))  # GPU: this layer's compute starts after its copy lands
            for t in loaded[i].values():
                mesh.used_here(t)  # made on the copy stream, freed after this stream is done with it
            with ctx.span(f"layer {i}", "compute"), _category(ctx, "activation"):
                h = functional_call(layer, loaded[i], (h,))  # (B, T, C)
            if i >= resident:
                del loaded[i]  # a streamed layer leaves as soon as it is done
    return h


__all__ = [
    "DTYPE_BYTES",
    "OffloadPlan",
    "bytes_per_param",
    "layer_bytes_of",
    "plan_layer_offload",
    "run_layer_by_layer",
]
