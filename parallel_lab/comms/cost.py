"""Byte and time formulas for the collectives in comms/core.py (the exact per-rank counts).

Invariant: these are the numbers the from-scratch collectives' counters must equal;
see comms/core.py's docstring for the chunking convention they follow.
"""

from __future__ import annotations

import math
import numbers


# ----------------------------------------------------------------------------- arithmetic
def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the p chunks of an n-element tensor: the first n % p get one more."""
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    q, m = divmod(numel, world_size)
    return [q + (1 if k < m else 0) for k in range(world_size)]


def ring_bytes_per_rank(numel: int, world_size: int, itemsize: int, op: str) -> list[tuple[int, int]]:
    """Exact (sent, recv) payload bytes of each rank for a ring `op` on `numel` elements.

    `op` is "all_reduce", "reduce_scatter" or "all_gather"; `numel` is the size of
    the whole tensor (the all-reduce input, the reduce-scatter input, the all-gather
    output). See the module docstring for the formula.
    """
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"op must be 'all_reduce', 'reduce_scatter' or 'all_gather', got {op!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p, c = world_size, chunk_sizes(numel, world_size)
    if p == 1:
        return [(0, 0)]
    out = []
    for r in range(p):
        rs = ((numel - c[r]) * itemsize, (numel - c[r - 1]) * itemsize)
        ag = ((numel - c[(r + 1) % p]) * itemsize, (numel - c[r]) * itemsize)
        out.append({"reduce_scatter": rs, "all_gather": ag}.get(op, (rs[0] + ag[0], rs[1] + ag[1])))
    return out


def tree_bytes_per_rank(
    numel: int, world_size: int, itemsize: int, op: str, root: int = 0
) -> list[tuple[int, int]]:
    """Exact (sent, recv) bytes per rank of a binomial-tree "broadcast" or "reduce" from/to `root`."""
    if op not in ("broadcast", "reduce"):
        raise ValueError(f"op must be 'broadcast' or 'reduce', got {op!r}")
    nbytes, p = numel * itemsize, world_size
    sent, recv = [0] * p, [0] * p
    for parent, child in _binomial_edges(p):  # relative ranks: 0 is the root
        a, b = (parent + root) % p, (child + root) % p
        if op == "broadcast":
            sent[a], recv[b] = sent[a] + nbytes, recv[b] + nbytes
        else:
            sent[b], recv[a] = sent[b] + nbytes, recv[a] + nbytes
    return list(zip(sent, recv))


def _binomial_edges(p: int) -> list[tuple[int, int]]:
    """(parent, child) pairs of a binomial tree over relative ranks 0..p-1, in round order."""
    edges, mask = [], 1
    while mask < p:
        edges += [(v, v + mask) for v in range(mask) if v + mask < p]
        mask *= 2
    return edges


def alpha_beta_seconds(algorithm: str, nbytes: int, world_size: int, alpha: float, bandwidth: float) -> float:
    """Alpha-beta time of an all-reduce of `nbytes`: steps * alpha + bytes-on-the-wire / bandwidth.

    "ring": 2(p-1) steps of nbytes/p each. "tree": reduce then broadcast down a
    binomial tree, 2*ceil(log2 p) steps of the whole message (a plain tree; NCCL's
    pipelined double tree gets the bandwidth term back down to ~nbytes).
    """
    p = world_size
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (p - 1) * (alpha + nbytes / p / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(p)) * (alpha + nbytes / bandwidth)
    raise ValueError(f"algorithm must be 'ring' or 'tree', got {algorithm!r}")


def multinode_all_reduce_seconds(nbytes: int, nodes: int, gpus_per_node: int, intra_bw: float, inter_bw: float,
                                 alpha: float = 0.0, hierarchical: bool = True) -> float:  # fmt: skip
    """Alpha-beta time (Thakur et al. 2005) of an all-reduce over nodes x gpus_per_node ranks.

    Flat ring over every rank, `hierarchical=False`: ONE ring, which leaves each node through one
    NIC, so every step waits on that NIC: 2(p-1) steps of nbytes/p at `inter_bw` (the single-NIC
    ring; NCCL runs several rings, one per NIC: `multirail_all_reduce_seconds`). Hierarchical
    (reduce-scatter inside each node, all-reduce of each 1/g shard across the nodes, all-gather
    inside the node, as Horovod's NCCLHierarchicalAllreduce does, horovod/common/ops/nccl_operations.cc): the network carries only the 1/g shards, 2(n-1)/n of nbytes/g per GPU at
    `inter_bw` per GPU, after and before the NVLink phases; 2(g-1) + 2(n-1) latency steps instead
    of the flat ring's 2(ng-1). `intra_bw` and `inter_bw` are bytes/s per GPU (NVLink; the node's
    network share of one GPU, i.e. one NIC per GPU).
    """
    g, n = gpus_per_node, nodes
    if g < 1 or n < 1:
        raise ValueError(f"nodes and gpus_per_node must be >= 1, got {nodes} and {gpus_per_node}")
    if n == 1:
        return alpha_beta_seconds("ring", nbytes, g, alpha, intra_bw)
    if not hierarchical:
        return alpha_beta_seconds("ring", nbytes, n * g, alpha, inter_bw)
    inside = (g - 1) * (
        alpha + nbytes / g / intra_bw
    )  # a reduce-scatter (and later an all-gather) in the node
    across = alpha_beta_seconds("ring", nbytes / g, n, alpha, inter_bw)
    return 2 * inside + across


def multirail_all_reduce_seconds(nbytes: int, nodes: int, gpus_per_node: int, intra_bw: float, inter_bw: float,
                                 alpha: float = 0.0) -> float:  # fmt: skip
    """Alpha-beta time of a ring all-reduce split over g rings, one per NIC (multi-rail).

    NCCL's topology search looks for as many concurrent flows as it can, each entering a node
    through a NIC, running through every GPU of the node over NVLink, and leaving through a NIC
    (NVIDIA/nccl issue #412; src/graph/search.cc): with g GPUs and g NICs per node, the rings
    ("channels"; NCCL often runs more channels than NICs, several sharing a NIC) spread the data
    over all g NICs, nbytes/g through each. A rank still sends 2(p-1)/p of nbytes in 2(p-1) steps,
    but the node's traffic now leaves through all g NICs at once: each NIC carries 2(p-1)/p of
    nbytes/g, and each GPU sends the other (g-1)/g of its share over NVLink, at the same time.
    The slower of the two sets the pace:

        2(p-1) alpha + 2(p-1)/p · nbytes · max(1 / (g · inter_bw), (g-1) / (g · intra_bw))

    with p = n·g. On one node every ring stays on NVLink: a plain ring at `intra_bw`.
    """
    g, n = gpus_per_node, nodes
    if g < 1 or n < 1:
        raise ValueError(f"nodes and gpus_per_node must be >= 1, got {nodes} and {gpus_per_node}")
    if n == 1:
        return alpha_beta_seconds("ring", nbytes, g, alpha, intra_bw)
    p = n * g
    volume = 2 * (p - 1) / p * nbytes  # what every rank sends, summed over the g rings
    return 2 * (p - 1) * alpha + volume * max(1 / (g * inter_bw), (g - 1) / (g * intra_bw))
