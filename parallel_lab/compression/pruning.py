"""Pruning: zero the weights that matter least, on a schedule, and let training recover.

Han et al. 2015 ("Learning both Weights and Connections"): remove the smallest-magnitude weights
and fine-tune. Zhu & Gupta 2017 ("To prune, or not to prune"): raise the sparsity gradually,
s_t = s_f + (s_i - s_f)(1 - t/n)³, so the network adapts as it loses weights. Mishra et al. 2021
(NVIDIA Ampere): 2:4 semi-structured sparsity keeps the 2 largest of every 4 consecutive weights, a
pattern sparse tensor cores multiply at twice the dense speed (on GPUs; a CPU runs the zeros
densely). `torch.nn.utils.prune.l1_unstructured` is the torch twin of `magnitude_mask`.

Invariant: `magnitude_mask(w, s)` zeroes exactly round(s · w.numel()) weights, the smallest in
|w|: the mask torch's `l1_unstructured` computes for the same amount (test).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel_lab.compression.task import Corpus, train_lm

__all__ = ["Pruner", "magnitude_mask", "prunable", "prune_and_finetune", "semi_structured_mask", "sparsity",
           "sparsity_schedule"]  # fmt: skip


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """True where a weight is kept: all but the round(sparsity · numel) smallest |weight|."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    k = round(sparsity * weight.numel())
    mask = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    if k:
        mask[torch.topk(weight.detach().abs().flatten(), k, largest=False).indices] = False
    return mask.view_as(weight)


def semi_structured_mask(weight: torch.Tensor) -> torch.Tensor:
    """2:4 sparsity: in every group of 4 consecutive weights along the input dim, keep the 2 largest |w|."""
    out_f, in_f = weight.shape
    if in_f % 4:
        raise ValueError(f"in_features ({in_f}) must be divisible by 4 for 2:4 sparsity")
    groups = weight.detach().abs().view(out_f, in_f // 4, 4)  # (out, in/4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(2, dim=2).indices, True)
    return keep.view(out_f, in_f)


def sparsity_schedule(step: int, steps: int, final: float, initial: float = 0.0) -> float:
    """Zhu & Gupta's cubic schedule: fast at first, gentle near the final sparsity."""
    t = min(max(step / steps, 0.0), 1.0)
    return final + (initial - final) * (1 - t) ** 3


def prunable(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers inside the transformer blocks (embeddings, LayerNorms and the head stay dense)."""
    return [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".blocks." in f".{name}"]


def sparsity(model: nn.Module) -> float:
    """Measured fraction of zeros among the prunable weights."""
    ws = [m.weight for m in prunable(model)]
    return sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws)


class Pruner:
    """Masks for a model's prunable layers; `apply()` zeroes the pruned weights (after every update)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = prunable(model)
        self.masks = [torch.ones_like(m.weight, dtype=torch.bool) for m in self.layers]

    def prune(self, amount: float | str) -> None:
        """Recompute every mask at `amount` sparsity by magnitude, or "2:4"; pruned weights stay pruned."""
        for i, m in enumerate(self.layers):
            w = m.weight.detach() * self.masks[i]
            self.masks[i] = semi_structured_mask(w) if amount == "2:4" else magnitude_mask(w, amount)
            m._compression_mask = self.masks[i]  # what `pack` stores sparsely
        self.apply()

    @torch.no_grad()
    def apply(self) -> None:
        for m, mask in zip(self.layers, self.masks):
            m.weight.mul_(mask)


def prune_and_finetune(model: nn.Module, corpus: Corpus, final: float | str, steps: int = 200,
                       prune_every: int = 20, **train_kw) -> list[float]:  # fmt: skip
    """Prune to `final` sparsity along the cubic schedule over the first 3/4 of `steps` (or 2:4 at once),
    fine-tuning all along; masks are re-applied after every optimizer step."""
    pruner = Pruner(model)
    ramp = max(1, steps * 3 // 4)

    def after_step(step: int) -> None:
        if final == "2:4":
            if step == 0:
                pruner.prune("2:4")
        elif step % prune_every == 0 or step == ramp:
            pruner.prune(sparsity_schedule(min(step + prune_every, ramp), ramp, final))
        pruner.apply()

    if final == "2:4":
        pruner.prune("2:4")
    return train_lm(model, corpus, steps, after_step=after_step, **train_kw)
