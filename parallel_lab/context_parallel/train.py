"""A TinyGPT trained on a DP x CP mesh: batch split over dp, sequence split over cp.

Every rank holds the whole model. Its tokens are a (batch/dp) x (seq/cp) tile of the global
batch, laid out by `shard_sequence` (so with zigzag a rank's tokens are two chunks of the
sequence, and the position embeddings take their absolute positions). Everything but attention
is per token and needs nothing from other ranks; attention runs `ring_attention` or
`ulysses_attention` over the CP group. Each rank's loss is the mean over its tokens; all ranks
hold equally many, so the global loss is their mean and the gradient all-reduce runs over every
rank of the mesh (dp x cp: the CP ranks hold the same weights too), divided by the rank count.

Invariant: losses and parameters after every step equal single-process training on the whole
batch (`models.train_reference`), up to float rounding (tests: 2e-5 on 4 ranks, 2 x 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_lab import comms
from parallel_lab.context_parallel.layout import positions, shard_sequence
from parallel_lab.context_parallel.ring import ring_attention
from parallel_lab.context_parallel.ulysses import ulysses_attention
from parallel_lab.models import TinyGPT, make_optimizer
from parallel_lab.runtime.parallel_dims import ParallelDims

METHODS = ("ring", "ulysses")


def cp_attention(ctx, attn, x: torch.Tensor, *, method: str, zigzag: bool, group) -> torch.Tensor:
    """`models.CausalSelfAttention` on this rank's tokens, its attention over the CP group's whole sequence."""
    B, T, C = x.shape
    nh = attn.n_heads
    q, k, v = attn.qkv(x).split(C, dim=2)  # 3 x (B, T_local, C)
    q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))  # (B, nh, T_local, hd)
    if method == "ring":
        y = ring_attention(ctx, q, k, v, causal=True, zigzag=zigzag, group=group)
    else:
        y = ulysses_attention(ctx, q, k, v, causal=True, group=group)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T_local, C)


def cp_loss(ctx, model: TinyGPT, idx: torch.Tensor, targets: torch.Tensor, pos: torch.Tensor, *,
            method: str = "ring", zigzag: bool = False, group=None) -> torch.Tensor:  # fmt: skip
    """Mean cross-entropy over this rank's tokens: idx, targets (B, T_local) at absolute positions `pos`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "ulysses" and zigzag:
        raise ValueError("zigzag is a ring-attention layout; ulysses_attention takes the contiguous one")
    x = model.wte(idx) + model.wpe(pos)  # (B, T_local, C)
    for block in model.blocks:
        x = x + cp_attention(ctx, block.attn, block.ln1(x), method=method, zigzag=zigzag, group=group)
        x = x + block.mlp(block.ln2(x))  # (B, T_local, C)
    logits = model.lm_head(model.ln_f(x))  # (B, T_local, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_dp_cp(ctx, model: TinyGPT, batches: list[tuple[torch.Tensor, torch.Tensor]], *, dp: int, cp: int,
                method: str = "ring", zigzag: bool = False, optimizer: str = "adam", lr: float = 1e-2,
                steps: int | None = None) -> dict:  # fmt: skip
    """Train `model` (the same on every rank) on the global `batches` split over a dp x cp mesh.

    Returns {"losses": global loss per step (before its update), "params": final parameters}."""
    dims = ParallelDims(dp=dp, cp=cp, world_size=ctx.world_size)
    mesh = dims.build(ctx)
    c = mesh.coords
    cp_rank, dp_rank = c.get("cp", 0), c["dp"]
    cp_group = mesh.group("cp") if cp > 1 else None
    if cp == 1:  # a one-rank "group": attention is local; the comms layer reads None as the world
        cp_group = _single(ctx)
    steps = len(batches) if steps is None else steps
    model = model.to(ctx.device)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        if x.shape[0] % dp:
            raise ValueError(f"batch size {x.shape[0]} must be divisible by dp = {dp}")
        rows = slice(dp_rank * (x.shape[0] // dp), (dp_rank + 1) * (x.shape[0] // dp))
        idx, tgt = (shard_sequence(t[rows], cp_rank, cp, dim=1, zigzag=zigzag).to(ctx.device) for t in (x, y))
        pos = positions(cp_rank, cp, x.shape[1], zigzag=zigzag, device=idx.device)
        with ctx.recorder.span("forward", kind="compute", step=i):
            loss = cp_loss(ctx, model, idx, tgt, pos, method=method, zigzag=zigzag, group=cp_group)
        opt.zero_grad(set_to_none=True)
        with ctx.recorder.span("backward", kind="compute", step=i):
            loss.backward()
        flat = torch.cat([p.grad.flatten() for p in params])  # one bucket: the lesson is the sequence split
        comms.ring_all_reduce(ctx, flat)  # sum over dp x cp: every rank holds the same weights
        flat /= ctx.world_size
        off = 0
        for p in params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        total = loss.detach().reshape(1).clone()
        comms.ring_all_reduce(ctx, total)
        losses.append(total.item() / ctx.world_size)
    return {"losses": losses, "params": [p.detach().cpu().clone() for p in model.parameters()]}


def _single(ctx):
    """A process group holding only this rank (every rank creates all of them, in the same order)."""
    import torch.distributed as dist

    mine = None
    for r in range(ctx.world_size):
        g = dist.new_group([r])
        if r == ctx.rank:
            mine = g
    return mine


__all__ = ["METHODS", "cp_attention", "cp_loss", "train_dp_cp"]
