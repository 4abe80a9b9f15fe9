"""Activation checkpointing (recomputation) from scratch: keep block inputs, redo the rest in backward.

Chen, Xu, Zhang & Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost";
seed 000 (checkpointing): a 24-layer transformer with 5 linear layers per layer
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
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from .alloc_mode import _storage


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
    too, so every segment keeps exactly one tensor (seed 000's 120 -> 24).
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


# ----------------------------------------------------------------------------- measuring what is saved
class SavedTensorCounter:
    """Counts the distinct storages autograd keeps for backward, live, with the peak.

    A `saved_tensors_hooks` pack hook sees every tensor an op saves (forward, and the
    recomputation in backward); each storage counts once (views and a tensor saved
    by two ops share it) until it is freed. Parameters (`exclude`) are not activations.
    `history` holds the live count after every change (for a memory-over-time plot).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {st._cdata for st in map(_storage, exclude) if st is not None}
        self._live: dict[int, tuple[int, Any]] = {}
        self.peak_count = self.peak_bytes = self.packs = 0
        self.history: list[int] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packs += 1
        st = _storage(t)
        if st is None or st._cdata in self._exclude:
            return t
        key, entry = st._cdata, self._live.get(st._cdata)
        if entry is None or entry[1]() is not st:
            self._live[key] = (st.nbytes(), weakref.ref(st, lambda r, k=key: self._free(k, r)))
            self.peak_count = max(self.peak_count, len(self._live))
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.history.append(len(self._live))
        return t

    def _free(self, key: int, ref: Any) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] is ref:
            del self._live[key]
            self.history.append(len(self._live))

    @property
    def live_count(self) -> int:
        """Distinct saved storages alive now."""
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes of the saved storages alive now."""
        return sum(e[0] for e in self._live.values())

    def __enter__(self) -> SavedTensorCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# ----------------------------------------------------------------------------- predictions
def predict_saved(
    saved: Sequence[int], inputs: Sequence[int], segments: int, checkpoint_last: bool = False,
    outside: int = 0, held: int = 0,
) -> dict[str, int]:  # fmt: skip
    """What `checkpoint_sequential` keeps, in any unit (tensors or bytes), for blocks that save
    `saved[i]` (their own input included) and take an input of size `inputs[i]`.

    after_forward: checkpointed segments keep their input, the others everything, plus
    `outside` (what the rest of the model saves). peak: the larger of that and each
    moment backward recomputes a segment: the inputs of that segment and of every
    segment before it, plus the segment's internals, plus `held` (what outside the
    blocks is still alive then, e.g. the embedding's token ids).
    """
    n = len(saved)
    if len(inputs) != n:
        raise ValueError(f"saved and inputs must have one entry per block, got {n} and {len(inputs)}")
    sizes = segment_sizes(n, segments)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    ckpt = [k < len(sizes) - 1 or checkpoint_last for k in range(len(sizes))]
    inner = [sum(saved[s : s + z]) for s, z in zip(starts, sizes)]
    after = outside + sum(inputs[s] if c else w for s, c, w in zip(starts, ckpt, inner))
    peak = after
    for k in range(len(sizes)):
        if ckpt[k]:
            kept = sum(inputs[starts[j]] for j in range(k + 1))
            peak = max(peak, held + kept + inner[k] - inputs[starts[k]])
    recomputed = sum(z for z, c in zip(sizes, ckpt) if c)
    return {"after_forward": after, "peak": peak, "recomputed_blocks": recomputed}


def gpt_saved_bytes(
    batch: int, seq: int, hidden: int, layers: int, heads: int, vocab: int, segments: int | None = None,
    checkpoint_last: bool = False, dtype_bytes: int = 4,
) -> dict[str, int]:  # fmt: skip
    """`predict_saved` in bytes for `gpt_forward` on a `models.TinyGPT`, from `costmodel`'s exact counts.

    Outside the blocks: token ids, positions and targets stay alive through backward
    (the caller holds ids and targets); the head's tensors are freed before the blocks' backward.
    """
    from .costmodel import activation_bytes, activation_bytes_per_layer

    per_layer = activation_bytes_per_layer(batch, seq, hidden, heads, dtype_bytes)
    outside = activation_bytes(batch, seq, hidden, 1, heads, vocab, dtype_bytes) - per_layer
    held = 2 * batch * seq * 8 + seq * 8  # token ids, targets (int64, (B, T)) and positions (T,)
    x = batch * seq * hidden * dtype_bytes  # a block's input (B, T, C)
    return predict_saved([per_layer] * layers, [x] * layers, segments or 1,
                         checkpoint_last and segments is not None, outside, held)  # fmt: skip


# ----------------------------------------------------------------------------- models
def seed_stack(layers: int = 24, linears: int = 5, hidden: int = 64, seed: int = 0) -> nn.Sequential:
    """Seed 000's picture: `layers` transformer-like layers of `linears` Linear layers each (ReLU
    between them), so each layer saves exactly `linears` activations: its input and each ReLU's output."""
    for name, v in (("layers", layers), ("linears", linears), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = []
        for _ in range(layers):
            mods: list[nn.Module] = []
            for i in range(linears):
                mods.append(nn.Linear(hidden, hidden))
                if i < linears - 1:
                    mods.append(nn.ReLU())
            blocks.append(nn.Sequential(*mods))
    return nn.Sequential(*blocks)


def gpt_forward(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None, segments: int | None = None,
    checkpoint_last: bool = False, ctx: Any = None,
) -> torch.Tensor:  # fmt: skip
    """`models.TinyGPT.forward` with its blocks run through `checkpoint_sequential` (None: no checkpointing)."""
    import torch.nn.functional as F

    B, T = idx.shape
    pos = torch.arange(T, device=idx.device)  # (T,)
    x = model.wte(idx) + model.wpe(pos)  # (B, T, C)
    if segments is None:
        for block in model.blocks:
            x = block(x)  # (B, T, C)
    else:
        x = checkpoint_sequential(model.blocks, segments, x, checkpoint_last=checkpoint_last, ctx=ctx)
    logits = model.lm_head(model.ln_f(x))  # (B, T, V)
    if targets is None:
        return logits
    return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


__all__ = [
    "SavedTensorCounter",
    "checkpoint",
    "checkpoint_sequential",
    "gpt_forward",
    "gpt_saved_bytes",
    "predict_saved",
    "seed_stack",
    "segment_sizes",
]
