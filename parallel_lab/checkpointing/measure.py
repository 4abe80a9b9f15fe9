"""Counting what autograd saves, predicting it, and the models lesson 07 measures.

Invariant: `SavedTensorCounter` counts the tensors autograd really keeps (saved-tensor
hooks, de-duplicated by storage); `predict_saved` must equal it for every spacing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from parallel_lab.checkpointing.recompute import checkpoint_sequential, segment_sizes
from parallel_lab.runtime.alloc_mode import storage_of


# ----------------------------------------------------------------------------- measuring what is saved
class SavedTensorCounter:
    """Counts the distinct storages autograd keeps for backward, live, with the peak.

    A `saved_tensors_hooks` pack hook sees every tensor an op saves (forward, and the
    recomputation in backward); each storage counts once (views and a tensor saved
    by two ops share it) until it is freed. Parameters (`exclude`) are not activations.
    `history` holds the live count after every change (for a memory-over-time plot).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {st._cdata for st in map(storage_of, exclude) if st is not None}
        self._live: dict[int, tuple[int, Any]] = {}
        self.peak_count = self.peak_bytes = self.packs = 0
        self.history: list[int] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packs += 1
        st = storage_of(t)
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
    from parallel_lab.costmodel import activation_bytes, activation_bytes_per_layer

    per_layer = activation_bytes_per_layer(batch, seq, hidden, heads, dtype_bytes)
    outside = activation_bytes(batch, seq, hidden, 1, heads, vocab, dtype_bytes) - per_layer
    held = 2 * batch * seq * 8 + seq * 8  # token ids, targets (int64, (B, T)) and positions (T,)
    x = batch * seq * hidden * dtype_bytes  # a block's input (B, T, C)
    return predict_saved([per_layer] * layers, [x] * layers, segments or 1,
                         checkpoint_last and segments is not None, outside, held)  # fmt: skip


# ----------------------------------------------------------------------------- models
def linear_stack(layers: int = 24, linears: int = 5, hidden: int = 64, seed: int = 0) -> nn.Sequential:
    """The textbook picture of checkpointing: `layers` transformer-like layers of `linears` Linear layers each (ReLU
    between them), so each layer saves exactly `linears` activations: its input and each ReLU's output."""
    for name, v in (("layers", layers), ("linears", linears), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone: torch.manual_seed would also reset every GPU's generator to
        # this seed, which fork_rng(devices=[]) does not restore (a rank's CUDA draws would restart)
        torch.default_generator.manual_seed(seed)
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
