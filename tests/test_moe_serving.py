"""Expert-parallel serving with redundant experts (lesson 21, `moe.serving`): on 4 gloo ranks, a fine-grained
MoE layer served from replicas gives the single-process layer's outputs, with and without copies, with and
without node-limited routing; the replicas each rank serves follow the placement, and EPLB's placement evens
out the tokens per rank that experts-in-order leave uneven (busiest rank 1.9-2.1x the mean before, under 1.2x
after; measured on the same tokens the placement was computed from)."""

from __future__ import annotations

import torch

from parallel_lab import launch
from parallel_lab.moe import FineGrainedMoE, ReplicatedExperts, rebalance_experts

T, D, E, K = 64, 12, 16, 4  # tokens per rank, width, routed experts, top-k


def _layer(max_groups=None) -> FineGrainedMoE:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = FineGrainedMoE(
            d_model=D, d_expert=8, n_shared=1, n_routed=E, k=K, groups=4, max_groups=max_groups
        )
    # a skew over experts spread across the groups: some experts picked far more than others
    layer.bias.copy_(
        torch.linspace(0.3, -0.3, E)[torch.randperm(E, generator=torch.Generator().manual_seed(3))]
    )
    return layer


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank))


def _serve(ctx, max_groups):
    torch.set_num_threads(1)
    layer = _layer(max_groups)
    loads = torch.zeros(E)
    for r in range(ctx.world_size):  # the placement's load estimate: every rank routes all tokens alike
        chosen, _ = layer.route(_tokens(r))
        loads += torch.bincount(chosen.reshape(-1), minlength=E)
    x = _tokens(ctx.rank)
    want, _, _ = layer(x)
    out = {}
    for name, phy2log in (
        ("in order", torch.arange(E)),
        ("EPLB", rebalance_experts(loads.view(1, E), 24, 4, 2, 4)[0][0]),
    ):
        served = ReplicatedExperts(ctx, layer, phy2log)
        y, _, rows = served(x, first_token=ctx.rank * T)
        out[name] = {
            "err": (y - want).abs().max().item(),
            "rows": sum(rows),
            "sent": ctx.recorder.comm_totals(),
        }
        ctx.recorder.reset()
    return out


def test_replicated_experts_serve_the_layers_outputs_and_even_out_the_ranks():
    for max_groups in (None, 2):
        res = launch(_serve, 4, max_groups, timeout=240, backend="gloo").values
        for name in ("in order", "EPLB"):
            assert max(v[name]["err"] for v in res) < 1e-5, (max_groups, name)
            assert sum(v[name]["rows"] for v in res) == 4 * T * K  # every choice served exactly once
        before = [v["in order"]["rows"] for v in res]
        after = [v["EPLB"]["rows"] for v in res]
        mean = 4 * T * K / 4
        assert max(after) / mean < max(before) / mean, (before, after)
        assert max(before) / mean > 1.8 and max(after) / mean < 1.2, (before, after)
