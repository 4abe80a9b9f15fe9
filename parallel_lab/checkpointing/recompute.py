"""Activation checkpointing (recomputation) from scratch: keep block inputs, redo the rest in backward.

Chen, Xu, Zhang & Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost".
A 24-layer transformer with 5 linear layers per layer
keeps 24 x 5 = 120 intermediate results for backward; keeping only each layer's
input keeps 24, and backward re-runs one layer's forward at a time to get the
rest back. Splitting n blocks into ~sqrt(n) segments balances the two terms of
the peak (segment inputs + one segment's internals); every checkpointed block
runs its forward twice, about 1/3 more compute for a step (forward F, backward
~2F, recompute F).

`checkpoint` is a custom autograd Function (the "reentrant" design of
torch.utils.checkpoint): its forward runs the segment under `no_grad` and saves
only the inputs; its backward replays the segment with grad on (same RNG state,
same autocast state) and back-propagates through the fresh graph. Parameters are
passed to the Function as inputs too, so its output requires grad and its backward
runs even when the segment's input does not (raw data, a frozen embedding).

Invariant: gradients equal those of the un-checkpointed model (the same ops run
on the same values); during forward a checkpointed segment keeps only its inputs
alive for backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn


# ----------------------------------------------------------------------------- segments
def segment_sizes(n: int, segments: int) -> list[int]:
    """Blocks per segment when `n` blocks are cut into `segments` runs (the first n % segments get one more)."""
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= n:
        raise ValueError(f"segments must be between 1 and the number of blocks ({n}), got {segments}")
    q, m = divmod(n, segments)
    return [q + (1 if k < m else 0) for k in range(segments)]


# ----------------------------------------------------------------------------- the Function
def _rng_state(device: torch.device) -> tuple:
    cpu = torch.get_rng_state()
    if device.type == "cpu":
        return (cpu, None)
    return (cpu, torch.get_device_module(device.type).get_rng_state(device))


@contextlib.contextmanager
def _replayed(state: dict) -> Any:
    """Run the recomputation with the RNG and autocast state forward had (dropout masks and dtypes match)."""
    dev = state["device"]
    rng = state["rng"]
    with contextlib.ExitStack() as stack:
        if rng is not None:
            devices = [] if dev.type == "cpu" else [dev]
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=dev.type))
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.get_device_module(dev.type).set_rng_state(rng[1], dev)
        for dtype_dev, (enabled, dtype) in state["autocast"].items():
            stack.enter_context(torch.autocast(dtype_dev, dtype=dtype, enabled=enabled))
        stack.enter_context(torch.enable_grad())
        yield


class _Recompute(torch.autograd.Function):
    """forward: run without saving anything inside, keep the inputs. backward: run again, differentiate."""

    @staticmethod
    def forward(fctx, run: Callable, state: dict, n_inputs: int, *tensors: torch.Tensor):
        inputs = tensors[:n_inputs]
        fctx.run, fctx.state, fctx.n_inputs = run, state, n_inputs
        fctx.n_params = len(tensors) - n_inputs
        fctx.save_for_backward(*inputs)  # the checkpoint: the only activation this segment keeps
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(fctx, *grad_outputs: torch.Tensor):
        state = fctx.state
        # Same storage as the saved input, a fresh autograd identity: the new graph starts here.
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in fctx.saved_tensors]
        span = state["ctx"].span(f"recompute {state['name']}", "compute") if state["ctx"] else None
        with span or contextlib.nullcontext(), _replayed(state):
            outputs = fctx.run(*inputs)
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o.requires_grad and g is not None]
        if pairs:
            # Back-propagate through the fresh graph: parameters accumulate into .grad here, as in
            # plain backward (their slots below return None); the inputs' gradients are returned.
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = [x.grad if x.requires_grad else None for x in inputs]
        return (None, None, None, *in_grads, *([None] * fctx.n_params))


def checkpoint(
    function: Callable[..., Any],
    *inputs: torch.Tensor,
    params: Iterable[torch.Tensor] | None = None,
    ctx: Any = None,
    name: str = "segment",
    preserve_rng_state: bool = True,
) -> Any:
    """`function(*inputs)` keeping only `inputs` for backward; the rest is recomputed in backward.

    `params`: the parameters `function` uses (default: `function.parameters()` for
    a module). With `ctx`, each recomputation is a span "recompute <name>" on the timeline.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"inputs must be tensors, input {i} is {type(x).__name__}")
    if not inputs:
        raise ValueError("checkpoint needs at least one tensor input (the checkpoint it keeps)")
    if params is None:
        params = function.parameters() if isinstance(function, nn.Module) else ()
    plist = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied weights once
    device = inputs[0].device
    autocast = {}
    for dt in {"cpu", device.type}:
        autocast[dt] = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
    state = {
        "ctx": ctx,
        "name": name,
        "device": device,
        "rng": _rng_state(device) if preserve_rng_state else None,
        "autocast": autocast,
    }
    return _Recompute.apply(function, state, len(inputs), *inputs, *plist)


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    segments: int,
    input: torch.Tensor,
    *,
    checkpoint_last: bool = False,
    ctx: Any = None,
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """Run blocks one after another in `segments` checkpointed runs: each keeps only its input.

    Like `torch.utils.checkpoint.checkpoint_sequential`, the last segment runs
    normally by default (its recomputation would come right after its own forward,
    so it would save nothing at the peak); `checkpoint_last=True` checkpoints it
    too, so every segment keeps exactly one tensor (24 layers x 5: 120 -> 24).
    """
    blocks = list(functions)
    if not blocks:
        raise ValueError("functions must hold at least one block")
    for i, f in enumerate(blocks):
        if not callable(f):
            raise TypeError(f"functions[{i}] must be callable, got {type(f).__name__}")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    sizes = segment_sizes(len(blocks), segments)
    x, start = input, 0
    for k, size in enumerate(sizes):
        seg = blocks[start : start + size]
        run = _Chain(seg)
        if k < len(sizes) - 1 or checkpoint_last:
            label = f"blocks {start}-{start + size - 1}" if size > 1 else f"block {start}"
            x = checkpoint(run, x, params=run.parameters(), ctx=ctx, name=label,
                           preserve_rng_state=preserve_rng_state)  # fmt: skip
        else:
            x = run(x)
        start += size
    return x


class _Chain:
    """A run of blocks called one after another (a plain object: no module registration side effects)."""

    def __init__(self, blocks: list[Callable]):
        self.blocks = blocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def parameters(self) -> list[torch.Tensor]:
        return [p for b in self.blocks if isinstance(b, nn.Module) for p in b.parameters()]


__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "segment_sizes",
]
