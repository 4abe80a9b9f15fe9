"""Low-rank factorization: a weight matrix replaced by the product of two thin ones.

Denton et al. 2014 and Jaderberg et al. 2014 for compressing layers this way; Eckart & Young 1936
for why the truncated SVD is the best rank-r approximation in the Frobenius norm. W (out x in) =
U S Vᵀ; keeping the r largest singular values gives W_r = (U_r S_r)(V_rᵀ): two Linears of
r(in + out) parameters instead of in·out, and the same ratio of multiply-adds. It pays when r <
in·out / (in + out).

Invariant: at full rank the factorized layer reproduces the original within float rounding
(test), and `low_rank_params` is the parameter count of the two factors.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from parallel_lab.compression.pruning import prunable

__all__ = ["factorize", "low_rank_linear", "low_rank_params", "reconstruction_error"]


def low_rank_params(in_features: int, out_features: int, rank: int, bias: bool = True) -> int:
    """r·(in + out) (+ out for the bias), against in·out (+ out) for the dense layer."""
    return rank * (in_features + out_features) + (out_features if bias else 0)


@torch.no_grad()
def low_rank_linear(linear: nn.Linear, rank: int) -> nn.Sequential:
    """Two Linears, in -> rank -> out, from the truncated SVD of `linear.weight`."""
    out_f, in_f = linear.weight.shape
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be an int in [1, {min(in_f, out_f)}], got {rank!r}")
    U, S, Vh = torch.linalg.svd(linear.weight.detach().double(), full_matrices=False)
    first = nn.Linear(in_f, rank, bias=False)
    second = nn.Linear(rank, out_f, bias=linear.bias is not None)
    first.weight.copy_(Vh[:rank].float())  # (r, in)
    second.weight.copy_((U[:, :rank] * S[:rank]).float())  # (out, r)
    if linear.bias is not None:
        second.bias.copy_(linear.bias)
    return nn.Sequential(first, second)


def reconstruction_error(linear: nn.Linear, rank: int) -> float:
    """||W - W_r||_F / ||W||_F for the rank-r truncation."""
    S = torch.linalg.svdvals(linear.weight.detach().double())
    return float((S[rank:] ** 2).sum().sqrt() / (S**2).sum().sqrt())


def factorize(model: nn.Module, fraction: float) -> nn.Module:
    """A copy with every block Linear replaced by its rank-r factors, r = round(fraction · min(in, out))."""
    out = copy.deepcopy(model)
    for module in list(out.modules()):
        for child_name, child in list(module.named_children()):
            if child in prunable(out):
                r = max(1, round(fraction * min(child.weight.shape)))
                setattr(module, child_name, low_rank_linear(child, r))
    return out
