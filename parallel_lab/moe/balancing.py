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

Node-limited routing (DeepSeek-V3, same report): with the experts spread over G groups (the nodes of
expert parallelism), a token may use experts of at most M groups, the M whose top-(k/M) selection
scores add up highest; the top-k is then taken among those groups' experts only. A token's experts
then sit on at most M nodes whatever k is (fewer bytes across nodes only with a dispatch that sends a
token once per node: `moe.dispatch`).

Invariant: the gates of a token are its unbiased scores of the experts it selected, normalised; the
bias changes which experts, never how much.
"""

from __future__ import annotations

import torch

__all__ = ["biased_topk", "max_violation", "node_limited_topk", "update_bias"]


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


def node_limited_topk(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int, max_groups: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`biased_topk` restricted to each token's best `max_groups` of `groups` equal groups of consecutive experts
    (a group = the experts of one node), a group scored by the sum of its top k / max_groups selection scores."""
    n, e = scores.shape[-2:] if scores.dim() == 2 else (0, 0)
    if (
        scores.dim() != 2
        or isinstance(groups, bool)
        or not isinstance(groups, int)
        or groups < 1
        or e % groups
    ):
        raise ValueError(f"groups must be a positive int dividing the {e} experts, got {groups!r}")
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or not 1 <= max_groups <= groups:
        raise ValueError(f"max_groups must be an int in [1, {groups}], got {max_groups!r}")
    if (
        isinstance(k, bool)
        or not isinstance(k, int)
        or k % max_groups
        or not 1 <= k <= max_groups * (e // groups)
    ):
        raise ValueError(f"k must be a multiple of max_groups ({max_groups}) and at most max_groups x experts per "
                         f"group ({max_groups * (e // groups)}), got {k!r}")  # fmt: skip
    select = (scores + bias).view(n, groups, e // groups)  # (N, G, experts per group)
    group_score = select.topk(k // max_groups, dim=-1).values.sum(-1)  # (N, G)
    keep = torch.zeros(n, groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, group_score.topk(max_groups, dim=-1).indices, True)  # (N, G): the token's groups
    masked = select.masked_fill(~keep[..., None], float("-inf")).view(n, e)  # other groups' experts: never
    chosen = masked.topk(k, dim=-1).indices  # (N, k)
    picked = scores.gather(-1, chosen)
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
