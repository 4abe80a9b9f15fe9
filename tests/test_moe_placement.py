"""Redundant experts placed onto GPUs (lesson 21, `moe.placement`): deepseek-ai/EPLB's README example
reproduced exactly, the placement's invariants on other loads (every expert served, every GPU the same
number of replicas, a group's experts on one node under the hierarchical policy), and the balance it
buys on skewed loads against experts placed in order without copies."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.moe import balanced_packing, gpu_loads, rebalance_experts, replicate


def test_the_readme_example_exactly():
    """EPLB's README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs (hierarchical)."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])  # fmt: skip
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]  # fmt: skip
    assert logcnt.sum(1).tolist() == [16, 16]
    for i in range(2):  # log2phy lists each expert's replicas, -1 after the last
        for e in range(12):
            reps = [j for j in log2phy[i, e].tolist() if j >= 0]
            assert len(reps) == logcnt[i, e] and all(phy2log[i, j] == e for j in reps)


@pytest.mark.parametrize("groups, nodes, gpus, replicas", [(8, 2, 16, 80), (4, 4, 8, 72), (6, 4, 8, 64)])
def test_invariants_and_the_balance_bought_on_skewed_loads(groups, nodes, gpus, replicas):
    """Zipf-like loads over 48 or 64 experts in random order, 10 draws: each GPU holds the same number of
    replicas, each expert at least one; hierarchical (nodes divide groups): a group's replicas all on one
    node; global (6 groups on 4 nodes): the same without groups. The largest GPU load over the mean falls
    from 2.0-4.8 (experts in order, no copies) to at most 1.2, except with one group per node (4 groups on
    4 nodes): the nodes then carry their groups' totals, which no packing inside a node can even out (up to
    1.96 here, still below the placement in order)."""
    n = 48 if groups == 6 else 64
    g = torch.Generator().manual_seed(groups * 100 + nodes)
    per_gpu, size = replicas // gpus, n // groups
    for _ in range(10):
        rank = torch.randperm(n, generator=g).double() + 1
        weight = (1000 / rank).round().view(1, n)
        phy2log, _, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
        assert sorted(phy2log[0].tolist()) == sorted(e for e in range(n) for _ in range(logcnt[0, e]))
        assert logcnt.min() >= 1 and logcnt.sum() == replicas
        if groups % nodes == 0:
            gpus_node = gpus // nodes
            node_of = [j // per_gpu // gpus_node for j in range(replicas)]
            for grp in range(groups):
                assert len({node_of[j] for j in range(replicas) if phy2log[0, j] // size == grp}) == 1
        after = gpu_loads(weight, phy2log, logcnt, gpus)
        before = gpu_loads(weight, torch.arange(n).view(1, n), torch.ones(1, n, dtype=torch.int64), gpus)
        a, b = (after.max() / after.mean()).item(), (before.max() / before.mean()).item()
        assert b > 2.0 and a < b and (a <= 1.2 or groups == nodes), (a, b)


def test_the_building_blocks():
    # heaviest first into the lightest pack with room: 9 -> 0, 7 -> 1, 6 -> 1, 5 -> 0 ... two items a pack
    assert balanced_packing([5, 9, 6, 7], 2) == ([0, 0, 1, 1], [1, 0, 1, 0])
    # the next copy to the largest load per copy: 10 -> 2 copies (5 each), then 6 (> 5)
    assert replicate([10, 6, 1], 5) == ([0, 1, 2, 0, 1], [0, 0, 0, 1, 1], [2, 2, 1])


def test_bad_input_is_named():
    w = torch.ones(1, 12)
    with pytest.raises(ValueError, match="num_replicas .* multiple of num_gpus"):
        rebalance_experts(w, 13, 4, 2, 8)
    with pytest.raises(ValueError, match="num_gpus .* multiple of num_nodes"):
        rebalance_experts(w, 16, 4, 3, 8)
    with pytest.raises(ValueError, match="num_groups .* must divide the 12 experts"):
        rebalance_experts(w, 16, 5, 1, 8)
    with pytest.raises(ValueError, match="weight must be a \\(layers, experts\\) tensor"):
        rebalance_experts(torch.ones(12), 16, 4, 2, 8)
    with pytest.raises(ValueError, match="packs must be >= 1 and divide"):
        balanced_packing([1.0, 2.0, 3.0], 2)
