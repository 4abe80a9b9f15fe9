"""Expert parallelism: experts spread over ranks, tokens moved by two all-to-alls.

GShard (Lepikhin et al. 2020) and the Switch Transformer shard an MoE layer's
experts over the ranks (E/p each) and keep everything else data-parallel. Each
rank routes its own tokens, then
  dispatch: an all-to-all sends every token to the rank that owns its expert;
  the owner runs each local expert once on the tokens it received from all ranks;
  combine:  a second all-to-all sends the outputs back, where the gates weight them.
Backward runs the same two exchanges in reverse (their gradients are all-to-alls too).

Two ways to pack the exchange:
- "padded" (GShard, DeepSpeed-MoE, Tutel): each rank sends a fixed (E/p, C, d)
  buffer to every rank, empty slots included; equal sizes, no bookkeeping;
- "exact" (Megatron-Core's all-to-all dispatcher): ranks first swap per-expert
  counts, then send only the tokens that exist.

`comms.all_to_all` and `comms.dist_all_to_all` need p equally shaped tensors, so the
uneven exchange here is `all_to_all_v`, traced and byte-counted by the same
machinery (`comms.TracedOp`).

Invariant: with the same routing (one GShard group per rank), forward outputs and
expert gradients equal the single-process `MoELayer`'s, and each rank's dispatch
sends exactly (choices routed to other ranks' experts) × d × itemsize bytes
("exact") or (p - 1) · (E/p) · C · d · itemsize bytes ("padded").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.moe.routing import MoELayer, Routing, combine

VARIANTS = ("exact", "padded")


def all_to_all_v(
    ctx, tensors: list[torch.Tensor], recv_rows: list[int], name: str = "all_to_all_v", group=None
):
    """Rank r sends tensors[j] (rows, *rest) to rank j and receives recv_rows[j] rows from each j.

    Rows may differ per pair (an "all-to-allv"); trailing shape and dtype agree. Pairwise
    exchange as in `comms.all_to_all`: at step s rank r sends to r+s, receives from r-s.
    One "comm" span named `name`; bytes counted are the rows that really travel.
    """
    with comms.TracedOp(ctx, name, tensors[0] if tensors else None, group) as o:
        if len(tensors) != o.p or len(recv_rows) != o.p:
            raise ValueError(f"tensors and recv_rows must hold one entry per rank ({o.p})")
        rest = tensors[0].shape[1:]
        if any(t.shape[1:] != rest or t.dtype != tensors[0].dtype for t in tensors):
            raise ValueError(
                "tensors must share their trailing shape and dtype (only the row count may differ)"
            )
        o.args["numel"] = sum(t.numel() for t in tensors)
        out = [tensors[0].new_empty((n, *rest)) for n in recv_rows]
        out[o.me] = tensors[o.me].clone()
        for s in range(1, o.p):
            dst, src = (o.me + s) % o.p, (o.me - s) % o.p
            o.xchg(tensors[dst].contiguous(), dst, out[src], src, "exchange")
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_v whose backward is the reverse exchange (gradients go back where rows came from)."""

    @staticmethod
    def forward(fctx, ctx, name, send_rows, recv_rows, group, *tensors):
        fctx.lab, fctx.name, fctx.rows, fctx.group = ctx, name, (send_rows, recv_rows), group
        return tuple(all_to_all_v(ctx, list(tensors), recv_rows, name, group))

    @staticmethod
    def backward(fctx, *grads):
        send_rows, _ = fctx.rows
        back = all_to_all_v(
            fctx.lab, [g.contiguous() for g in grads], send_rows, fctx.name + ".grad", fctx.group
        )
        return (None, None, None, None, None, *back)


def exchange(
    ctx, tensors: list[torch.Tensor], recv_rows: list[int], name: str, group=None
) -> list[torch.Tensor]:
    """Differentiable `all_to_all_v`."""
    send_rows = [t.shape[0] for t in tensors]
    return list(_AllToAll.apply(ctx, name, send_rows, recv_rows, group, *tensors))


def expert_owner(expert: int, num_experts: int, world_size: int) -> int:
    """Experts are split in contiguous blocks of E/p: expert e lives on rank e // (E/p)."""
    return expert // (num_experts // world_size)


class ExpertParallelMoE(nn.Module):
    """An `MoELayer` with its experts sharded over the ranks of `group` (router replicated).

    Built from a full layer that every rank constructed identically (`build_moe(cfg,
    seed)`): this rank keeps experts [r·E/p, (r+1)·E/p). `forward(x)` routes this
    rank's tokens as one GShard group and returns (y, aux_loss, routing).
    """

    def __init__(self, ctx, layer: MoELayer, variant: str = "exact", group=None):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        g = group if group is not None else ctx.group  # None: the world
        p, r = dist.get_world_size(g), dist.get_rank(g)
        E = layer.cfg.num_experts
        if E % p:
            raise ValueError(f"num_experts ({E}) must be divisible by the number of ranks ({p})")
        self.ctx, self.group, self.variant, self.p, self.rank = ctx, g, variant, p, r
        self.num_experts, self.local = E, E // p
        self.router = layer.router
        self.experts = nn.ModuleList(layer.experts[r * self.local : (r + 1) * self.local])

    def forward(self, x: torch.Tensor, seed: int = 0):
        xf = x.reshape(-1, x.shape[-1])  # (N_r, d) this rank's tokens
        with self.ctx.span("route", "compute", tokens=xf.shape[0]):
            routing = self.router(xf, torch.Generator().manual_seed(seed + self.rank))
        move = self._exact if self.variant == "exact" else self._padded
        out = move(xf, routing)  # [e] -> (counts[e], d), outputs of this rank's tokens
        with self.ctx.span("combine", "compute"):
            y = combine(torch.zeros_like(xf), routing, out)  # (N_r, d)
        return y.reshape(x.shape), routing.aux_loss, routing

    def _run_experts(self, blocks: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """blocks[src][e_local] (n, d) -> outputs of local expert e_local, same layout."""
        with self.ctx.span("experts", "compute"):
            outs: list[list[torch.Tensor]] = [[] for _ in blocks]
            for j, expert in enumerate(self.experts):
                sizes = [b[j].shape[0] for b in blocks]
                y = expert(torch.cat([b[j] for b in blocks]))  # (Σ sizes, d): one call per expert
                for src, part in enumerate(y.split(sizes)):
                    outs[src].append(part)
        return outs

    def _exact(self, xf: torch.Tensor, routing: Routing) -> list[torch.Tensor]:
        L = self.local
        counts = routing.counts  # (E,)
        with self.ctx.span("permute", "compute"):
            # rows for expert e, grouped by destination rank: the send buffer of each rank
            rows = [
                xf[routing.expert_tokens[e, : int(counts[e])]] for e in range(self.num_experts)
            ]  # [e] (n_e, d)
            send = [torch.cat(rows[q * L : (q + 1) * L]) for q in range(self.p)]  # [q] (Σ n_e, d)
        # receivers must size their buffers: swap the per-expert counts first (p tensors of (E/p,))
        got = comms.all_to_all(self.ctx, list(counts.view(self.p, L)), group=self.group)  # [src] (E/p,)
        recv_counts = torch.stack(got).tolist()  # [src][e_local]
        recv = exchange(self.ctx, send, [sum(c) for c in recv_counts], "moe_dispatch", self.group)
        blocks = [list(t.split(c)) for t, c in zip(recv, recv_counts)]  # [src][e_local] (n, d)
        outs = self._run_experts(blocks)
        back = exchange(
            self.ctx, [torch.cat(o) for o in outs], [t.shape[0] for t in send], "moe_combine", self.group
        )
        return [part for q in range(self.p) for part in back[q].split(counts[q * L : (q + 1) * L].tolist())]

    def _padded(self, xf: torch.Tensor, routing: Routing) -> list[torch.Tensor]:
        L, d, C = self.local, xf.shape[1], routing.capacity
        counts = routing.counts
        with self.ctx.span("permute", "compute"):
            filled = (routing.expert_tokens >= 0).unsqueeze(-1)  # (E, C, 1)
            buf = xf[routing.expert_tokens.clamp(min=0)] * filled  # (E, C, d), zeros in empty slots
            send = list(buf.reshape(self.p, L * C, d))  # [q] (E/p * C, d)
        recv = exchange(self.ctx, send, [L * C] * self.p, "moe_dispatch", self.group)  # [src] (E/p*C, d)
        blocks = [list(t.view(L, C, d).unbind(0)) for t in recv]  # [src][e_local] (C, d), padding too
        outs = self._run_experts(blocks)
        back = exchange(self.ctx, [torch.cat(o) for o in outs], [L * C] * self.p, "moe_combine", self.group)
        full = torch.cat(back).view(self.num_experts, C, d)  # (E, C, d)
        return [full[e, : int(counts[e])] for e in range(self.num_experts)]


def dispatch_bytes(routing: Routing, rank: int, world_size: int, d: int, itemsize: int, variant: str) -> int:
    """Bytes this rank's dispatch all-to-all sends (its combine receives the same)."""
    E = routing.counts.numel()
    L = E // world_size
    if variant == "padded":
        return (world_size - 1) * L * routing.capacity * d * itemsize
    remote = [e for e in range(E) if expert_owner(e, E, world_size) != rank]
    return int(routing.counts[remote].sum()) * d * itemsize


__all__ = ["VARIANTS", "ExpertParallelMoE", "all_to_all_v", "dispatch_bytes", "exchange", "expert_owner"]
