"""Auxiliary-loss-free balancing (lesson 21, `moe.balancing`): the bias update rule, the bias changing which
experts a token picks but never its gates, and the bias evening out a skewed router over steps."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.moe import biased_topk, max_violation, update_bias


def test_the_update_rule():
    b = update_bias(torch.zeros(3), torch.tensor([5, 1, 3]), 0.01)  # mean load 3
    assert torch.equal(b, torch.tensor([-0.01, 0.01, 0.0]))  # overloaded down, underloaded up, average kept
    assert max_violation(torch.tensor([5, 1, 3])) == pytest.approx(5 / 3 - 1)


def test_the_bias_changes_the_choice_never_the_gates():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(256, 8, generator=g)
    plain, plain_gates = biased_topk(scores, torch.zeros(8), 2)
    bias = torch.zeros(8)
    bias[5] = 0.3  # expert 5 made easier to pick
    chosen, gates = biased_topk(scores, bias, 2)
    moved = (chosen != plain).any(-1)
    assert moved.any() and (chosen[moved] == 5).any(-1).all()  # every token that moved now has expert 5
    picked = scores.gather(-1, chosen)
    assert torch.allclose(gates, picked / picked.sum(-1, keepdim=True))  # gates: unbiased scores, normalised
    assert torch.equal(gates[~moved], plain_gates[~moved])  # a token that kept its experts kept its gates


def test_the_bias_evens_out_a_skewed_router():
    """1,024 tokens a step over 16 experts, top-2, sigmoid affinities skewed towards the first experts,
    200 steps of fresh tokens. No bias: the busiest expert gets about 2.9 times the mean (MaxVio ~1.9) to
    the end. gamma = 1e-3: MaxVio below 0.3 over the last 20 steps. gamma = 0.05: the bias overshoots every
    step and MaxVio stays higher than with 1e-3."""

    def race(gamma: float) -> float:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 16, generator=g) / 32**0.5
        skew = torch.linspace(1.0, -1.0, 16)
        b, last = torch.zeros(16), []
        for step in range(200):
            s = torch.sigmoid(torch.randn(1024, 32, generator=g) @ w + skew)  # (tokens, experts)
            idx, _ = biased_topk(s, b, 2)
            load = torch.bincount(idx.reshape(-1), minlength=16)
            if step >= 180:
                last.append(max_violation(load))
            b = update_bias(b, load, gamma)
        return sum(last) / len(last)

    none, small, large = race(0.0), race(1e-3), race(0.05)
    assert none > 1.5 and small < 0.3 and small < large, (none, small, large)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="k must be an int in \\[1, 4\\]"):
        biased_topk(torch.rand(3, 4), torch.zeros(4), 5)
    with pytest.raises(ValueError, match="bias \\(experts,\\)"):
        biased_topk(torch.rand(3, 4), torch.zeros(3), 1)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        update_bias(torch.zeros(2), torch.ones(2), -1.0)


def test_node_limited_routing_keeps_each_token_on_its_best_groups():
    """64 experts on 8 nodes, top-8: unlimited, a token's experts spread over 5-6 nodes on average; limited to
    M = 4, never more than 4, chosen by each node's top-2 scores; M = G gives the unlimited choice back."""
    from parallel_lab.moe import node_limited_topk

    g = torch.Generator().manual_seed(0)
    s = torch.sigmoid(torch.randn(512, 64, generator=g))
    b = torch.zeros(64)
    free, _ = biased_topk(s, b, 8)
    limited, gates = node_limited_topk(s, b, 8, groups=8, max_groups=4)
    nodes = lambda chosen: torch.tensor([len(set((c // 8).tolist())) for c in chosen]).double()  # noqa: E731
    assert nodes(free).mean() > 4.5 and nodes(limited).max() <= 4
    best = (s.view(512, 8, 8).topk(2, dim=-1).values.sum(-1)).topk(4, dim=-1).indices.sort(-1).values
    assert all(set((c // 8).tolist()) <= set(bst.tolist()) for c, bst in zip(limited, best))
    assert torch.allclose(gates, s.gather(-1, limited) / s.gather(-1, limited).sum(-1, keepdim=True))
    again, _ = node_limited_topk(s, b, 8, groups=8, max_groups=8)
    assert torch.equal(again.sort(-1).values, free.sort(-1).values)
    with pytest.raises(ValueError, match="k must be a multiple of max_groups"):
        node_limited_topk(s, b, 6, groups=8, max_groups=4)
