"""Expert-parallel inference with redundant experts and node-limited routing (lesson 21).

Lesson 11's `ExpertParallelMoE` gives each rank E/p experts and moves each token to the rank of its
expert. At serving time the token counts per expert are far from even, so the busiest rank sets
the pace. DeepSeek-V3 (arXiv 2412.19437, its section on inference and deployment) serves with
redundant experts: `moe.placement.rebalance_experts` (EPLB's policy) gives the hot experts extra
replicas and packs the replicas so every GPU expects about the same tokens; a token then goes to
ONE replica of each expert it chose. Here a token's replica of expert e is the
(global token index mod count_e)-th, so each replica gets an equal share of e's tokens.

With node-limited routing (`moe.balancing.node_limited_topk`, groups = the expert groups the
placement packed onto nodes), each token's experts sit on at most M nodes; this layer's dispatch is
one all-to-all, so a token still sends one row per choice served by another rank (up to k), and
only a two-hop dispatch (`moe.dispatch.TwoHopExperts`) turns the limit into fewer bytes.

`ReplicatedExperts(ctx, layer, phy2log, group)` serves a `FineGrainedMoE`: rank r holds replicas
[r R/p, (r+1) R/p) of `phy2log` (R replicas; weights copied from the layer every rank built the same),
runs the shared experts on its own tokens, and moves routed tokens with two all-to-alls (the rows,
their replica ids, then the outputs back). Forward only (serving).

Invariant: outputs equal the single-process layer's with the same routing (up to the order of the
sums), whatever the placement; each rank's dispatch sends (choices served by other ranks) x d x
itemsize bytes of rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab.moe.expert_parallel import all_to_all_v
from parallel_lab.moe.fine_grained import FineGrainedMoE

__all__ = ["ReplicatedExperts", "replica_of"]


def replica_of(chosen: torch.Tensor, first_token: int, log2phy: list[list[int]]) -> torch.Tensor:
    """(T, k) chosen experts of tokens first_token.. -> (T, k) physical replica ids: token t uses
    replica (first_token + t) mod count_e of expert e (each replica an equal share of e's tokens)."""
    t = (
        torch.arange(first_token, first_token + chosen.shape[0], device=chosen.device)
        .unsqueeze(-1)
        .expand_as(chosen)
    )
    out = torch.empty_like(chosen)
    for e in chosen.unique().tolist():
        reps = torch.tensor(log2phy[e], device=chosen.device)
        mask = chosen == e
        out[mask] = reps[t[mask] % len(reps)]
    return out


class ReplicatedExperts(nn.Module):
    """The routed experts of `layer` as replicas spread over the ranks of `group` (module docstring).

    `phy2log`: (R,) the logical expert of each physical replica, R a multiple of the ranks (one row of
    `rebalance_experts`' output; `torch.arange(E)` is the placement without copies). `forward(x, first_token)`
    -> (y, chosen, served): y the layer's output for this rank's tokens (x's shape), chosen (T, k), and
    served: how many token rows each local replica computed (received from every rank, this one too)."""

    def __init__(self, ctx, layer: FineGrainedMoE, phy2log: torch.Tensor, group=None):
        super().__init__()
        g = group if group is not None else ctx.group
        self.ctx, self.group = ctx, g
        self.p, self.rank = dist.get_world_size(g), dist.get_rank(g)
        self.phy2log = [int(e) for e in phy2log.tolist()]
        n, R = len(layer.routed), len(self.phy2log)
        if R % self.p or sorted(set(self.phy2log)) != list(range(n)):
            raise ValueError(f"phy2log must name every one of the {n} experts, with a length ({R}) the {self.p} "
                             "ranks divide")  # fmt: skip
        self.per_rank = R // self.p
        self.log2phy = [[j for j, e in enumerate(self.phy2log) if e == x] for x in range(n)]
        self.layer = layer  # the router and the shared experts, replicated on every rank
        mine = self.phy2log[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        self.replicas = nn.ModuleList(layer.routed[e] for e in mine)  # this rank's copies of their weights

    @torch.no_grad()
    def forward(self, x: torch.Tensor, first_token: int = 0):
        xf = x.reshape(-1, x.shape[-1])  # (T, d) this rank's tokens
        T, k = xf.shape[0], self.layer.k
        chosen, gates = self.layer.route(xf)  # (T, k) each
        rep = replica_of(chosen, first_token, self.log2phy)  # (T, k) the replica serving each choice
        dest = rep // self.per_rank  # (T, k) its rank
        order = (dest * (len(self.phy2log) + 1) + rep).reshape(-1).argsort(stable=True)  # by rank, replica
        tok = torch.arange(T, device=xf.device).repeat_interleave(k)[
            order
        ]  # (T k,) token of each choice, in send order
        rep_sorted, dest_sorted = rep.reshape(-1)[order], dest.reshape(-1)[order]
        counts = torch.bincount(dest_sorted, minlength=self.p).tolist()
        rows = list(xf[tok].split(counts))  # [q] (n_q, d): rows for rank q
        ids = list(rep_sorted.unsqueeze(-1).split(counts))  # [q] (n_q, 1): the replica each row is for
        got_n = [int(c) for c in all_to_all_v(self.ctx, [torch.tensor([[c]], device=xf.device) for c in counts], [1] * self.p,
                                              "moe_counts", self.group)]  # fmt: skip
        recv = torch.cat(all_to_all_v(self.ctx, rows, got_n, "moe_dispatch", self.group))  # (Σ, d)
        recv_ids = torch.cat(all_to_all_v(self.ctx, ids, got_n, "moe_dispatch_ids", self.group)).view(-1)
        out = torch.empty_like(recv)
        served = []
        for j, expert in enumerate(self.replicas):  # each local replica once, on the rows sent to it
            where = (recv_ids == self.rank * self.per_rank + j).nonzero(as_tuple=True)[0]
            served.append(int(where.numel()))
            if where.numel():
                out[where] = expert(recv[where])
        back = torch.cat(all_to_all_v(self.ctx, list(out.split(got_n)), counts, "moe_combine", self.group))
        y = sum((s(xf) for s in self.layer.shared), torch.zeros_like(xf))
        g = gates.reshape(-1)[order].unsqueeze(-1).to(xf.dtype)  # (T k, 1) in send order
        y = y.index_add(0, tok, g * back)
        return y.reshape(x.shape), chosen, served
