"""Fine-grained and shared experts (DeepSeekMoE) with a biased router (lesson 21).

Dai et al. 2024 ("DeepSeekMoE: Towards Ultimate Expert Specialization in Mixture-of-Experts Language
Models", arXiv 2401.06066): cut each expert of lesson 11 into m smaller ones (d_ff / m wide) and route
each token to m times as many: the same parameters and FLOPs, many more combinations of experts to
specialise; and keep N_s experts **shared**, used by every token, so the common knowledge is not
learned again in every routed expert. DeepSeek-V3 (arXiv 2412.19437, its architecture section) routes
with sigmoid affinities, selects with the load-balancing bias of `moe.balancing`, and normalises the
gates over the selected experts.

    y = sum over the N_s shared experts of FFN_i(x) + sum over the k selected routed experts of g_j FFN_j(x)

Per token: (N_s + k) expert passes and the router's d x N_r scores, whatever N_r is; parameters:
(N_s + N_r) experts and the router (`moe_counts`).

Invariant: the layer's output and gradients equal `dense_reference`, which runs every expert on every
token and weighs it by the token's gate (zero for an expert not selected).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel_lab.moe.balancing import biased_topk, node_limited_topk
from parallel_lab.moe.routing import Expert

__all__ = ["FineGrainedMoE", "dense_reference", "moe_counts"]


class FineGrainedMoE(nn.Module):
    """`n_shared` experts every token uses plus `n_routed` routed ones, `k` per token, each d_model -> d_expert
    -> d_model. `bias` (a buffer, zeros) shifts the selection only (`moe.balancing.update_bias` moves it).
    `max_groups`: node-limited routing over `groups` equal groups of consecutive experts.
    `forward(x)` -> (y of x's shape, chosen (tokens, k), gates (tokens, k))."""

    def __init__(self, d_model: int = 16, d_expert: int = 8, n_shared: int = 1, n_routed: int = 8, k: int = 2,
                 groups: int = 1, max_groups: int | None = None):  # fmt: skip
        super().__init__()
        for name, v, low in (("d_model", d_model, 1), ("d_expert", d_expert, 1), ("n_shared", n_shared, 0),
                             ("n_routed", n_routed, 1), ("k", k, 1)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if k > n_routed:
            raise ValueError(f"k ({k}) must be at most n_routed ({n_routed})")
        self.k, self.groups, self.max_groups = k, groups, max_groups  # node-limited when max_groups is set
        self.shared = nn.ModuleList(Expert(d_model, d_expert) for _ in range(n_shared))
        self.routed = nn.ModuleList(Expert(d_model, d_expert) for _ in range(n_routed))
        self.router = nn.Linear(d_model, n_routed, bias=False)
        self.register_buffer("bias", torch.zeros(n_routed))

    def route(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.router(xf).float())  # (N, n_routed) affinities, fp32
        if self.max_groups is not None:  # each token's experts in its best max_groups groups (nodes)
            return node_limited_topk(scores, self.bias.float(), self.k, self.groups, self.max_groups)
        return biased_topk(scores, self.bias.float(), self.k)  # (N, k) each

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xf = x.reshape(-1, x.shape[-1])  # (N, d)
        chosen, gates = self.route(xf)
        y = torch.zeros_like(xf)
        for expert in self.shared:  # every token, weight 1
            y = y + expert(xf)
        for e, expert in enumerate(self.routed):  # each routed expert on its own tokens only
            tok, slot = (chosen == e).nonzero(as_tuple=True)  # (n_e,), (n_e,)
            if tok.numel():
                y = y.index_add(0, tok, gates[tok, slot, None].to(xf.dtype) * expert(xf[tok]))
        return y.reshape(x.shape), chosen, gates


def dense_reference(layer: FineGrainedMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, each weighted by the token's gate for it (0 if not selected)."""
    xf = x.reshape(-1, x.shape[-1])
    chosen, gates = layer.route(xf)
    weight = torch.zeros(xf.shape[0], len(layer.routed), dtype=gates.dtype).scatter(
        1, chosen, gates
    )  # (N, E)
    y = sum((expert(xf) for expert in layer.shared), torch.zeros_like(xf))
    for e, expert in enumerate(layer.routed):
        y = y + weight[:, e : e + 1].to(xf.dtype) * expert(xf)
    return y.reshape(x.shape)


def moe_counts(d_model: int, d_expert: int, n_shared: int, n_routed: int, k: int) -> dict[str, int]:
    """Parameters of the layer and matmul FLOPs per token (forward: 2 per multiply-add)."""
    expert = 2 * d_model * d_expert + d_expert + d_model  # fc and proj, with biases
    return {
        "params": (n_shared + n_routed) * expert + d_model * n_routed,
        "flops_per_token": 2 * (d_model * n_routed + (n_shared + k) * 2 * d_model * d_expert),
    }
