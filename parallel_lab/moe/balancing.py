"""Load balancing without an auxiliary loss: a per-expert bias on the routing scores (lesson 21).

Wang et al. 2024 ("Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", arXiv
2408.15664) and DeepSeek-V3 (arXiv 2412.19437, its section on the auxiliary-loss-free strategy): the
Switch loss of lesson 11 balances the experts by adding a gradient to the router, which also pulls
the model away from what the language-modelling loss wants. Instead, keep one bias b_e per expert,
used only to choose the experts:

    selected = top-k over e of (s_e + b_e),       gate_e = s_e / sum of s over the selected experts,

so the bias moves tokens between experts but never enters the output or its gradient; after each
step, b_e += gamma * sign(mean load - load_e): an overloaded expert becomes harder to pick, an
underloaded one easier. DeepSeek-V3's scores are sigmoid affinities, normalised over the selected
experts as above.

Invariant: the gates of a token are its unbiased scores of the experts it selected, normalised; the
bias changes which experts, never how much.
"""

from __future__ import annotations

import torch

__all__ = ["biased_topk", "max_violation", "update_bias"]


def biased_topk(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, experts) scores, (experts,) bias -> (tokens, k) expert ids chosen by score + bias, and their
    (tokens, k) gates: the unbiased scores of those experts, normalised to sum 1 per token."""
    if scores.dim() != 2 or bias.shape != scores.shape[-1:]:
        raise ValueError(f"scores must be (tokens, experts) and bias (experts,), got {tuple(scores.shape)} and "
                         f"{tuple(bias.shape)}")  # fmt: skip
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be an int in [1, {scores.shape[-1]}], got {k!r}")
    chosen = (scores + bias).topk(k, dim=-1).indices  # (tokens, k): the bias decides which
    picked = scores.gather(-1, chosen)  # (tokens, k): the gates never see it
    return chosen, picked / picked.sum(-1, keepdim=True)


def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """b_e + gamma * sign(mean load - load_e): the step's (experts,) token counts push the bias back."""
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean() - load)


def max_violation(load: torch.Tensor) -> float:
    """max load / mean load - 1 (Wang et al. 2024's MaxVio): 0 when every expert gets the same tokens."""
    load = load.double()
    return float(load.max() / load.mean() - 1)
