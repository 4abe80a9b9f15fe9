"""Node-aware expert-parallel dispatch (lesson 21, `moe.dispatch`) and the MoE cost model (`costmodel.moe`).

On 4 gloo ranks (2 nodes x 2) and 8 (2 x 4), one launch each: the flat and two-hop layers give the
single-process `FineGrainedMoE`'s outputs and gradients (input, router, shared and routed experts) within
1e-5, node-limited (max_groups=1) and not; each rank's traced cross-node rows equal `dispatch_cross_bytes`;
two-hop never sends more across nodes than flat, and a token crosses at most min(M, G - 1) times (M - 1 when
its own node is among its M). The cost model's expectations against Monte Carlo of the lab's routers."""

from __future__ import annotations

import pytest
import torch

from parallel_lab import launch
from parallel_lab.costmodel.moe import (
    DEEPSEEK_V3,
    MoESpec,
    cross_node_rows,
    deepseek_v3_row,
    expected_nodes,
    node_limited_floor,
)
from parallel_lab.moe import FineGrainedMoE, NodeMesh, TwoHopExperts, dispatch_cross_bytes
from parallel_lab.moe.balancing import biased_topk, node_limited_topk

T, D, E, K, NODES = 24, 12, 16, 4, 2  # tokens per rank, width, routed experts, top-k, nodes
CASES = [(mg, v) for mg in (None, 1) for v in ("flat", "two_hop")]


def _layer(max_groups):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FineGrainedMoE(d_model=D, d_expert=8, n_shared=1, n_routed=E, k=K, groups=NODES,
                              max_groups=max_groups)  # fmt: skip


def _data(rank: int):
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank))
    w = torch.randn(T, D, generator=torch.Generator().manual_seed(200 + rank))  # the loss: sum(y * w)
    return x, w


def _run(ctx):
    torch.set_num_threads(1)
    mesh = NodeMesh(NODES).build(ctx)
    res = {}
    for mg, v in CASES:
        layer = _layer(mg)
        ctx.recorder.reset()
        x, w = _data(ctx.rank)
        x.requires_grad_()
        y, chosen, _ = TwoHopExperts(ctx, layer, mesh, v)(x)
        (y * w).sum().backward()
        res[(mg, v)] = {
            "y": y.detach(), "x_grad": x.grad, "chosen": chosen,
            "grads": {n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
            "by_op": ctx.recorder.comm_totals()["by_op"],
            "formula": dispatch_cross_bytes(chosen, ctx.rank, mesh, E, D, 4, v),
        }  # fmt: skip
    return res


def _reference(p: int, max_groups):
    layer = _layer(max_groups)
    xs, ws = zip(*(_data(r) for r in range(p)))
    x = torch.cat(xs).requires_grad_()
    y, chosen, _ = layer(x)
    (y * torch.cat(ws)).sum().backward()
    return layer, y.detach(), x.grad, chosen


def _sent(res, op, key="sent"):
    return res["by_op"].get(op, {}).get(key, 0)


@pytest.fixture(scope="module", params=[4, 8], ids=["4 ranks (2x2)", "8 ranks (2x4)"])
def runs(request):
    p = request.param
    return p, launch(_run, p, timeout=120, backend="gloo").values


def test_outputs_and_gradients_equal_the_single_process_layer(runs):
    p, out = runs
    for mg, v in CASES:
        layer, y, x_grad, chosen = _reference(p, mg)
        for r in range(p):
            got = out[r][(mg, v)]
            mine = slice(r * T, (r + 1) * T)
            assert torch.equal(got["chosen"], chosen[mine]), (p, mg, v, r)
            assert (got["y"] - y[mine]).abs().max() < 1e-5, (p, mg, v, r)
            assert (got["x_grad"] - x_grad[mine]).abs().max() < 1e-5, (p, mg, v, r)
        for name, prm in layer.named_parameters():
            if name.startswith("routed."):  # on its owner only
                owner = int(name.split(".")[1]) // (E // p)
                assert all(name not in out[r][(mg, v)]["grads"] for r in range(p) if r != owner), name
                got = out[owner][(mg, v)]["grads"].get(name, torch.zeros_like(prm))
            else:  # replicated: each rank's gradient is its tokens' share
                got = sum(out[r][(mg, v)]["grads"][name] for r in range(p))
            want = prm.grad if prm.grad is not None else torch.zeros_like(prm)
            assert (got - want).abs().max() < 1e-5, (p, mg, v, name)


def test_cross_node_bytes_equal_the_formula_and_two_hop_sends_fewer(runs):
    p, out = runs
    for mg, v in CASES:
        for r in range(p):
            got = out[r][(mg, v)]
            assert _sent(got, "moe_dispatch_inter") == got["formula"], (p, mg, v, r)
            # the results come back, and the gradients of the rows go back in backward
            assert _sent(got, "moe_combine_inter", "recv") == got["formula"], (p, mg, v, r)
            assert _sent(got, "moe_dispatch_inter.grad", "recv") == got["formula"], (p, mg, v, r)
    for mg in (None, 1):
        for r in range(p):
            flat, two = out[r][(mg, "flat")], out[r][(mg, "two_hop")]
            assert two["formula"] <= flat["formula"], (p, mg, r)
    # node-limited routing cuts the two-hop bytes (flat's expectation it leaves as it is: `costmodel.moe`)
    assert sum(out[r][(1, "two_hop")]["formula"] for r in range(p)) < sum(
        out[r][(None, "two_hop")]["formula"] for r in range(p)
    )


def test_a_token_crosses_at_most_once_per_other_node_it_needs(runs):
    """Node-limited (M = 1 of G = 2): a two-hop token crosses at most min(M, G - 1) = 1 times, and 0 times when
    its one node is its own (M - 1); flat sends one row per choice, up to k = 4 for one token."""
    p, out = runs
    M, per_node = 1, E // NODES
    for r in range(p):
        node = r // (p // NODES)
        chosen = out[r][(1, "two_hop")]["chosen"]
        nodes = chosen // per_node
        assert ((nodes == nodes[:, :1]).all(-1)).all()  # node-limited: one node per token
        crossings = (nodes[:, 0] != node).long()
        assert crossings.max() <= min(M, NODES - 1)
        assert _sent(out[r][(1, "two_hop")], "moe_dispatch_inter") == int(crossings.sum()) * D * 4
        flat_rows = (nodes != node).sum(-1)
        assert flat_rows.max() == K and bool((flat_rows[crossings == 0] == 0).all())


def test_expected_nodes_match_monte_carlo_of_the_routers():
    g = torch.Generator().manual_seed(0)
    for experts, nodes, k in ((16, 2, 4), (16, 4, 2), (256, 8, 8)):
        s = torch.rand(20000, experts, generator=g)
        chosen, _ = biased_topk(s, torch.zeros(experts), k)
        hit = torch.zeros(len(s), nodes, dtype=torch.bool).scatter(1, chosen // (experts // nodes), True)
        mc = hit.sum(-1).double().mean().item()
        assert abs(mc - expected_nodes(experts, nodes, k)) < 0.01 * nodes, (experts, nodes, k, mc)
        other = (hit.sum(-1) - hit[:, 0].long()).double().mean()  # a token of node 0: its other nodes
        assert abs(other - cross_node_rows(experts, nodes, k)) < 0.02 * nodes
        flat = (chosen // (experts // nodes) != 0).sum(-1).double().mean()
        assert abs(flat - cross_node_rows(experts, nodes, k, variant="flat")) < 0.02 * k
    # node-limited: between the floor and M; M exactly at M = 1; within 1.5% of M at DeepSeek-V3's shape
    for experts, nodes, k, m, close in ((16, 2, 4, 1, 0.0), (16, 4, 2, 2, None), (256, 8, 8, 4, 0.015)):
        s = torch.rand(4000, experts, generator=g)
        chosen, _ = node_limited_topk(s, torch.zeros(experts), k, nodes, m)
        hit = torch.zeros(len(s), nodes, dtype=torch.bool).scatter(1, chosen // (experts // nodes), True)
        mc = hit.sum(-1).double().mean().item()
        assert node_limited_floor(experts, nodes, k, m) - 0.02 <= mc <= m, (experts, nodes, k, m, mc)
        if close is not None:
            assert mc >= (1 - close) * expected_nodes(experts, nodes, k, m), (experts, nodes, k, m, mc)


def test_deepseek_v3_row_orders_the_variants_and_bad_inputs_are_named():
    row = deepseek_v3_row()
    b, share = row["cross_bytes_per_layer"], row["a2a_share"]
    assert b["two_hop_node_limited"] < b["two_hop"] < b["flat"] == b["flat_node_limited"]
    assert share["two_hop_node_limited"] < share["two_hop"] < share["flat"] < 1
    assert row["cross_rows_per_token"]["two_hop_node_limited"] == 4 * 7 / 8
    assert row["experts_per_gpu"] == 4 and DEEPSEEK_V3.expert_dp == 2 and DEEPSEEK_V3.dp == 128
    with pytest.raises(ValueError, match="max_nodes .* must be at most nodes"):
        expected_nodes(256, 8, 8, max_nodes=9)
    with pytest.raises(ValueError, match=r"nodes \(3\) must divide experts"):
        cross_node_rows(16, 3, 2)
    with pytest.raises(ValueError, match=r"ep \(48\) must divide routed"):
        MoESpec(**{**DEEPSEEK_V3.__dict__, "ep": 48})
    with pytest.raises(ValueError, match="mfu must be in"):
        deepseek_v3_row(mfu=1.5)
    with pytest.raises(ValueError, match="variant must be one of"):
        TwoHopExperts(None, _layer(None), NodeMesh(NODES), "ring")
    with pytest.raises(ValueError, match="mesh must be built"):
        TwoHopExperts(None, _layer(None), NodeMesh(NODES), "flat")
    with pytest.raises(ValueError, match="variant must be one of"):
        dispatch_cross_bytes(
            torch.zeros(1, K, dtype=torch.long), 0, NodeMesh(NODES, world=4), E, D, 4, "ring"
        )
