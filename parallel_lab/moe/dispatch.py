"""Node-aware expert-parallel dispatch: each token crosses the network once per node it needs (lesson 21).

With experts spread over p ranks on G nodes (L = p/G ranks each), lesson 11's dispatch is one
all-to-all over the world: a token that chose three experts on node B sends its row across the
network three times, node-limited routing or not. DeepEP (deepseek-ai/DeepEP, its README: kernels
"optimized for asymmetric-domain bandwidth forwarding, such as forwarding data from NVLink domain to
RDMA domain", to match DeepSeek-V3's group-limited gating, arXiv 2412.19437) sends a token at most once
to each node it needs, over the network, to the GPU with the same index in that node, which forwards it
inside the node to the GPUs holding its experts. With node-limited routing (`moe.balancing.node_limited_topk`, at most M nodes)
a token then crosses at most M times whatever k is.

`NodeMesh(nodes)`: rank r = node x L + local; groups `intra` (the L ranks of a node) and `inter`
(the G ranks with the same local index), built once, in the same order on every rank.

`TwoHopExperts(ctx, layer, mesh, variant)`: the expert-parallel forward and backward of a
`FineGrainedMoE` (rank r holds experts [r E/p, (r+1) E/p); node g holds the experts of its L ranks,
which is routing group g when `layer.groups == G`):
- "flat": each (token, choice) row goes straight to its expert's rank, gates applied at home. The
  world all-to-all is traced as two ops, its cross-node pairs ("moe_dispatch_inter") and its in-node
  pairs ("moe_dispatch_intra"), the combine likewise ("moe_combine_inter", "moe_combine_intra");
- "two_hop": hop 1 over `inter` sends each token's row once to every other node holding one of its
  experts ("moe_dispatch_inter"), with its k expert ids ("moe_ids_inter", int64) and gates
  ("moe_gates_inter"); hop 2 over `intra` forwards each row once to every rank of the node holding
  one of its experts ("moe_dispatch_intra", "moe_ids_intra", "moe_gates_intra"). An expert rank
  returns one row per row received, its experts' outputs weighted by their gates and summed
  ("moe_combine_intra"); the forwarding rank sums those into one partial per token per node, which
  crosses back once ("moe_combine_inter").
Before each hop the ranks swap their row counts ("moe_counts", "moe_counts_inter", "moe_counts_intra":
8 bytes per peer), and flat sends each row's expert id beside it ("moe_ids").
Every exchange is differentiable (its backward is the reverse exchange, "<name>.grad").

Bytes of rows a rank sends across nodes in the dispatch (`dispatch_cross_bytes`), d x itemsize each:
    flat:     choices whose expert is on another node            (up to k per token)
    two_hop:  distinct other nodes among the token's choices     (up to min(k, G - 1, M) per token)
and the combine brings back as many. The ids and gates (k x 12 bytes a row) travel beside the rows.

Invariant: outputs and the gradients of the input, the router, the shared and the routed experts
equal the single-process `FineGrainedMoE` on the union of the ranks' tokens (up to the order of the
sums), for both variants; each rank's "moe_dispatch_inter" sends `dispatch_cross_bytes` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab.moe.expert_parallel import all_to_all_v
from parallel_lab.moe.fine_grained import FineGrainedMoE

__all__ = ["DISPATCH_VARIANTS", "NodeMesh", "TwoHopExperts", "dispatch_cross_bytes"]

DISPATCH_VARIANTS = ("flat", "two_hop")


@dataclass
class NodeMesh:
    """p ranks as `nodes` nodes of p/nodes consecutive ranks. `build(ctx)` makes the groups (every rank,
    same order); then `node`, `local`, `intra` and `inter` describe this rank."""

    nodes: int
    world: int = 0
    rank: int = 0
    intra: Any = None  # the L ranks of this rank's node (group rank = local index)
    inter: Any = None  # the G ranks with this rank's local index (group rank = node)

    @property
    def per_node(self) -> int:
        return self.world // self.nodes

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    @property
    def local(self) -> int:
        return self.rank % self.per_node

    def node_of_rank(self, r: int) -> int:
        return r // self.per_node

    def build(self, ctx) -> NodeMesh:
        g = self.nodes
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or ctx.world_size % g:
            raise ValueError(
                f"nodes must be a positive int dividing world_size ({ctx.world_size}), got {g!r}"
            )
        self.world, self.rank = ctx.world_size, ctx.rank
        L = self.per_node
        every = [("intra", [n * L + j for j in range(L)]) for n in range(g)]
        every += [("inter", [n * L + j for n in range(g)]) for j in range(L)]
        for axis, ranks in every:  # the same calls in the same order on every rank
            h = dist.group.WORLD if len(ranks) == self.world else dist.new_group(ranks)
            if self.rank in ranks:
                setattr(self, axis, h)
        return self


class _Exchange(torch.autograd.Function):
    """Several `all_to_all_v`s as ONE autograd node: backward runs their reverse exchanges in the same
    order on every rank (two separate nodes could be reached in different orders on different ranks,
    and a collective's peers would wait on each other)."""

    @staticmethod
    def forward(fctx, lab, group, names, recv_rows, counts, anchor, *flat):
        fctx.lab, fctx.group, fctx.names, fctx.recv, fctx.counts = lab, group, names, recv_rows, counts
        fctx.send = [
            [t.shape[0] for t in flat[sum(counts[:i]) : sum(counts[: i + 1])]] for i in range(len(names))
        ]
        out = []
        for i, name in enumerate(names):
            part = list(flat[sum(counts[:i]) : sum(counts[: i + 1])])
            out += all_to_all_v(lab, part, recv_rows[i], name, group)
        return tuple(out)

    @staticmethod
    def backward(fctx, *grads):
        back = []
        for i, name in enumerate(fctx.names):
            part = [g.contiguous() for g in grads[sum(fctx.counts[:i]) : sum(fctx.counts[: i + 1])]]
            back += all_to_all_v(fctx.lab, part, fctx.send[i], name + ".grad", fctx.group)
        return (None, None, None, None, None, None, *back)


def _exchange(ctx, group, parts: list[tuple[str, list[torch.Tensor], list[int]]]) -> list[list[torch.Tensor]]:
    """parts: (name, tensors to each group rank, rows from each) -> the received tensors of each part."""
    # A zero-size leaf that wants a gradient puts every exchange into the graph on every rank, whatever
    # this rank's tokens: each backward is a collective, so a rank that skipped one would leave its peers waiting.
    flat = [t for _, ts, _ in parts for t in ts]
    anchor = torch.empty(0, device=flat[0].device, requires_grad=torch.is_grad_enabled())
    out = _Exchange.apply(ctx, group, [n for n, _, _ in parts], [r for _, _, r in parts],
                          [len(ts) for _, ts, _ in parts], anchor, *flat)  # fmt: skip
    res, i = [], 0
    for _, ts, _ in parts:
        res.append(list(out[i : i + len(ts)]))
        i += len(ts)
    return res


def _counts(ctx, group, send_rows: list[int], name: str, device) -> list[int]:
    """Swap the row counts (the receivers size their buffers with them)."""
    got = all_to_all_v(ctx, [torch.tensor([[c]], device=device) for c in send_rows], [1] * len(send_rows), name,
                       group)  # fmt: skip
    return [int(g) for g in got]


class TwoHopExperts(nn.Module):
    """The routed experts of `layer` spread over the ranks of `mesh` (built), moved "flat" or "two_hop"
    (module docstring). `forward(x)` -> (y of x's shape, chosen (T, k), gates (T, k))."""

    def __init__(self, ctx, layer: FineGrainedMoE, mesh: NodeMesh, variant: str = "two_hop"):
        super().__init__()
        if variant not in DISPATCH_VARIANTS:
            raise ValueError(f"variant must be one of {DISPATCH_VARIANTS}, got {variant!r}")
        if mesh.intra is None:
            raise ValueError("mesh must be built first: NodeMesh(nodes).build(ctx)")
        E, p = len(layer.routed), mesh.world
        if E % p:
            raise ValueError(f"n_routed ({E}) must be divisible by the number of ranks ({p})")
        if layer.max_groups is not None and layer.groups != mesh.nodes:
            raise ValueError(f"node-limited routing needs layer.groups == mesh.nodes (a routing group is a node), "
                             f"got groups={layer.groups}, nodes={mesh.nodes}")  # fmt: skip
        self.ctx, self.mesh, self.variant, self.layer = ctx, mesh, variant, layer
        self.per_rank = E // p
        self.first = mesh.rank * self.per_rank
        self.experts = nn.ModuleList(layer.routed[self.first : self.first + self.per_rank])

    def forward(self, x: torch.Tensor):
        xf = x.reshape(-1, x.shape[-1])  # (T, d) this rank's tokens
        chosen, gates = self.layer.route(xf)  # (T, k) each
        y = sum((s(xf) for s in self.layer.shared), torch.zeros_like(xf))
        move = self._flat if self.variant == "flat" else self._two_hop
        y = move(xf, chosen, gates, y)
        return y.reshape(x.shape), chosen, gates

    def _run(self, rows: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """One output row per row received: sum over this rank's experts among the row's ids of gate x FFN."""
        out = rows * 0  # tied to the received rows, so the exchange stays in the graph with no rows here
        for j, expert in enumerate(self.experts):
            row, slot = (ids == self.first + j).nonzero(as_tuple=True)
            if row.numel():
                out = out.index_add(0, row, gates[row, slot, None].to(rows.dtype) * expert(rows[row]))
        return out

    def _flat(self, xf, chosen, gates, y):
        m, T, k = self.mesh, *chosen.shape
        dest = chosen // self.per_rank  # (T, k) the expert's rank
        order = chosen.reshape(-1).argsort(stable=True)  # by expert, so by rank
        tok = torch.arange(T, device=xf.device).repeat_interleave(k)[order]
        ids = chosen.reshape(-1)[order]
        counts = torch.bincount(dest.reshape(-1), minlength=m.world).tolist()
        rows = list(xf[tok].split(counts))  # [q] (n_q, d)
        id_parts = list(ids.unsqueeze(-1).split(counts))
        got = _counts(self.ctx, None, counts, "moe_counts", xf.device)
        recv_ids = torch.cat(all_to_all_v(self.ctx, id_parts, got, "moe_ids"))
        same = [m.node_of_rank(q) == m.node for q in range(m.world)]
        empty = xf.new_empty(0, xf.shape[1])
        # the world all-to-all as its cross-node pairs, then its in-node pairs: the same messages, two names
        inter, intra = _exchange(self.ctx, None, [
            ("moe_dispatch_inter", [empty if s else r for s, r in zip(same, rows)], [0 if s else n for s, n in zip(same, got)]),
            ("moe_dispatch_intra", [r if s else empty for s, r in zip(same, rows)], [n if s else 0 for s, n in zip(same, got)]),
        ])  # fmt: skip
        recv = torch.cat([b if s else a for s, a, b in zip(same, inter, intra)])
        ones = torch.ones(recv.shape[0], 1, dtype=gates.dtype, device=xf.device)  # gates are applied at home
        out = list(self._run(recv, recv_ids, ones).split(got))
        back_inter, back_intra = _exchange(self.ctx, None, [
            ("moe_combine_inter", [empty if s else o for s, o in zip(same, out)], [0 if s else n for s, n in zip(same, counts)]),
            ("moe_combine_intra", [o if s else empty for s, o in zip(same, out)], [n if s else 0 for s, n in zip(same, counts)]),
        ])  # fmt: skip
        back = torch.cat([b if s else a for s, a, b in zip(same, back_inter, back_intra)])
        g = gates.reshape(-1)[order].unsqueeze(-1).to(xf.dtype)
        return y.index_add(0, tok, g * back)

    def _two_hop(self, xf, chosen, gates, y):
        m, T = self.mesh, chosen.shape[0]
        L, G = m.per_node, m.nodes
        experts_per_node = self.per_rank * L
        node_hit = torch.zeros(T, G, dtype=torch.bool, device=xf.device)
        node_hit.scatter_(1, chosen // experts_per_node, True)  # (T, G): the nodes each token needs
        # hop 1 (inter): each token once to every other node it needs, to the rank with this local index
        to_node = [node_hit[:, h].nonzero(as_tuple=True)[0] for h in range(G)]  # [h] token ids
        send_n = [0 if h == m.node else len(t) for h, t in enumerate(to_node)]
        got1 = _counts(self.ctx, m.inter, send_n, "moe_counts_inter", xf.device)
        pick = [to_node[h] if h != m.node else to_node[h][:0] for h in range(G)]
        ids1 = all_to_all_v(self.ctx, [chosen[t] for t in pick], got1, "moe_ids_inter", m.inter)
        rows1, gates1 = _exchange(self.ctx, m.inter, [
            ("moe_dispatch_inter", [xf[t] for t in pick], got1),
            ("moe_gates_inter", [gates[t] for t in pick], got1),
        ])  # fmt: skip
        # what this rank forwards: its own tokens that need this node, then each other node's rows
        own = to_node[m.node]
        rows = torch.cat([xf[own]] + [rows1[h] for h in range(G) if h != m.node])
        ids = torch.cat([chosen[own]] + [ids1[h] for h in range(G) if h != m.node])
        gts = torch.cat([gates[own]] + [gates1[h] for h in range(G) if h != m.node])
        # hop 2 (intra): each row once to every rank of this node holding one of its experts
        # (n, k) the local index of each choice's rank (a choice on another node: outside [0, L))
        on_rank = ids // self.per_rank - m.node * L
        to_rank = [(on_rank == j).any(-1).nonzero(as_tuple=True)[0] for j in range(L)]
        send2 = [len(t) for t in to_rank]
        got2 = _counts(self.ctx, m.intra, send2, "moe_counts_intra", xf.device)
        ids2 = torch.cat(all_to_all_v(self.ctx, [ids[t] for t in to_rank], got2, "moe_ids_intra", m.intra))
        rows2, gates2 = _exchange(self.ctx, m.intra, [
            ("moe_dispatch_intra", [rows[t] for t in to_rank], got2),
            ("moe_gates_intra", [gts[t] for t in to_rank], got2),
        ])  # fmt: skip
        out = list(self._run(torch.cat(rows2), ids2, torch.cat(gates2)).split(got2))
        (back2,) = _exchange(self.ctx, m.intra, [("moe_combine_intra", out, send2)])
        # one partial sum per row (token x node) from this node's experts, then back over the network
        partial = rows * 0
        for j in range(L):
            partial = partial.index_add(0, to_rank[j], back2[j])
        sizes = [len(own)] + [got1[h] for h in range(G) if h != m.node]
        pieces = list(partial.split(sizes))
        home, it = pieces[0], iter(pieces[1:])
        back_parts = [home[:0] if h == m.node else next(it) for h in range(G)]
        (back1,) = _exchange(self.ctx, m.inter, [("moe_combine_inter", back_parts, send_n)])
        y = y.index_add(0, own, home)
        for h in range(G):
            y = y.index_add(0, pick[h], back1[h])
        return y


def dispatch_cross_bytes(chosen: torch.Tensor, rank: int, mesh: NodeMesh, experts: int, d: int, itemsize: int,
                         variant: str) -> int:  # fmt: skip
    """Bytes of rows rank `rank` sends across nodes in the dispatch for its (T, k) `chosen` experts (module
    docstring): "flat" a row per choice on another node, "two_hop" a row per other node a token needs."""
    if variant not in DISPATCH_VARIANTS:
        raise ValueError(f"variant must be one of {DISPATCH_VARIANTS}, got {variant!r}")
    if not mesh.world or experts % mesh.world:
        raise ValueError(f"experts ({experts}) must be divisible by mesh.world ({mesh.world}); give NodeMesh its world "
                         "or build it")  # fmt: skip
    per_node = experts // mesh.nodes
    node = chosen // per_node  # (T, k)
    own = mesh.node_of_rank(rank)
    if variant == "flat":
        rows = int((node != own).sum())
    else:
        hit = torch.zeros(chosen.shape[0], mesh.nodes, dtype=torch.bool).scatter(1, node.cpu(), True)
        hit[:, own] = False
        rows = int(hit.sum())
    return rows * d * itemsize
