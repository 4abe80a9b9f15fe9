"""Redundant experts: replicate the hot experts and pack the replicas onto GPUs (lesson 21).

DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, its section on inference and deployment) serves its
MoE layers with redundant experts: the experts that receive the most tokens get extra copies, and the
copies are placed so that every GPU receives about the same number of tokens. deepseek-ai/EPLB
publishes the placement it deploys, `rebalance_experts(weight, num_replicas, num_groups, num_nodes,
num_gpus)`; this module implements the same interface and policy (its README describes the policy; the
order in which ties are broken follows its `eplb.py`, so that the README's example comes out exactly):

- **hierarchical** (when the nodes divide the expert groups): pack the expert groups onto nodes so
  the nodes' loads are balanced (group-limited routing then keeps a token's experts on few nodes),
  replicate experts inside each node, then pack each node's replicas onto its GPUs;
- **global** (otherwise): the same with one group and one node: replicate across all experts, then
  pack onto all GPUs.

The two building blocks are greedy: `replicate` gives the next copy to the expert whose load per copy
is the largest (which minimises the largest load per copy), and `balanced_packing` takes items from
the heaviest down and puts each into the lightest pack that still has room (every pack gets the same
number of items, since a GPU holds a fixed number of expert slots). Neither is optimal in general
(packing is NP-hard); both are what the placement does, and the tests bound how far from the ideal
(total load / GPUs) they land.

Loads are token counts per logical expert, one row per MoE layer. Physical experts (replicas) are
numbered node by node, GPU by GPU: replica j lives on GPU j // (num_replicas / num_gpus).

Invariant: every logical expert has at least one replica, every GPU the same number of replicas,
and (hierarchical) all replicas of an expert on the node its group was packed to.
"""

from __future__ import annotations

import torch

__all__ = ["balanced_packing", "gpu_loads", "rebalance_experts", "replicate"]


def balanced_packing(loads: list[float], packs: int) -> tuple[list[int], list[int]]:
    """Items onto `packs` packs of len(loads) / packs items each, heaviest first into the lightest pack with
    room (ties: the lower pack). Returns each item's (pack, position in its pack)."""
    n = len(loads)
    if packs < 1 or n % packs:
        raise ValueError(f"packs must be >= 1 and divide the {n} items, got {packs}")
    per = n // packs
    pack, pos = [0] * n, [0] * n
    weight, count = [0.0] * packs, [0] * packs
    for i in sorted(range(n), key=lambda i: -loads[i]):  # heaviest first; equal loads in index order
        k = min((k for k in range(packs) if count[k] < per), key=lambda k: weight[k])
        pack[i], pos[i] = k, count[k]
        weight[k] += loads[i]
        count[k] += 1
    return pack, pos


def replicate(loads: list[float], copies: int) -> tuple[list[int], list[int], list[int]]:
    """`copies` >= len(loads) replicas: one of each expert, then each next one to the expert with the largest
    load per replica (ties: the lower expert). Returns (replica -> expert, replica -> its copy number,
    expert -> replica count)."""
    n = len(loads)
    if copies < n:
        raise ValueError(f"copies ({copies}) must be at least the number of experts ({n})")
    to_expert, rank, count = list(range(n)), [0] * n, [1] * n
    for _ in range(n, copies):
        e = max(range(n), key=lambda e: (loads[e] / count[e], -e))
        to_expert.append(e)
        rank.append(count[e])
        count[e] += 1
    return to_expert, rank, count


def _place_layer(load: list[float], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
                 ) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """One layer, hierarchical: (physical -> logical, physical -> copy number, logical -> replica count)."""
    n = len(load)
    size, per_node = n // num_groups, n // num_nodes  # experts per group, logical experts per node
    # 1. groups onto nodes, balanced by the groups' total loads
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(num_groups)]
    node, pos = balanced_packing(group_load, num_nodes)
    groups_per_node = num_groups // num_nodes
    # node-major order of the logical experts: node 0's groups (by position), then node 1's...
    order = [None] * n
    for g in range(num_groups):
        first = (node[g] * groups_per_node + pos[g]) * size
        for j in range(size):
            order[first + j] = g * size + j
    phy2log, phyrank, logcnt = [], [], [0] * n
    reps_node, gpus_node = num_replicas // num_nodes, num_gpus // num_nodes
    slots = num_replicas // num_gpus  # replicas per GPU
    for v in range(num_nodes):
        experts = order[v * per_node : (v + 1) * per_node]  # this node's logical experts
        # 2. replicas inside the node
        to_e, rank, count = replicate([load[e] for e in experts], reps_node)
        # 3. replicas onto the node's GPUs, each replica carrying its expert's load / its copies
        gpu, slot = balanced_packing([load[experts[e]] / count[e] for e in to_e], gpus_node)
        placed = [0] * reps_node
        for r in range(reps_node):
            placed[gpu[r] * slots + slot[r]] = r
        for r in placed:
            phy2log.append(experts[to_e[r]])
            phyrank.append(rank[r])
        for e, c in zip(experts, count):
            logcnt[e] = c
    return phy2log, phyrank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """EPLB's interface: `weight` (layers, experts) of token counts ->
    `phy2log` (layers, num_replicas): the logical expert of each replica, replicas numbered GPU by GPU;
    `log2phy` (layers, experts, most replicas of an expert): each expert's replicas, -1 padded;
    `logcnt` (layers, experts): how many replicas each expert has.
    Hierarchical when `num_nodes` divides `num_groups`, global otherwise (module docstring)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a (layers, experts) tensor, got {getattr(weight, 'shape', weight)!r}"
        )
    layers, n = weight.shape
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_replicas < n or num_replicas % num_gpus:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the {n} experts and a multiple of num_gpus ({num_gpus})"
        )
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if n % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the {n} experts")
    if num_groups % num_nodes:  # the global policy: one group, one node
        num_groups = num_nodes = 1
    if num_replicas % num_nodes:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_nodes ({num_nodes})")
    rows = [_place_layer(weight[i].double().tolist(), num_replicas, num_groups, num_nodes, num_gpus)
            for i in range(layers)]  # fmt: skip
    phy2log = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    logcnt = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    log2phy = torch.full((layers, n, int(logcnt.max())), -1, dtype=torch.int64)
    for i, (p2l, rank, _) in enumerate(rows):
        for j, (e, k) in enumerate(zip(p2l, rank)):
            log2phy[i, e, k] = j
    return phy2log, log2phy, logcnt


def gpu_loads(
    weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int
) -> torch.Tensor:
    """(layers, num_gpus) tokens each GPU serves when every expert's tokens are split evenly over its replicas."""
    per_replica = weight.double().gather(1, phy2log) / logcnt.double().gather(
        1, phy2log
    )  # (layers, replicas)
    return per_replica.view(weight.shape[0], num_gpus, -1).sum(-1)
