"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade the sequence split for a head split.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models". Outside attention each of the N ranks holds T/N tokens with
all H heads. Attention needs every token, but heads are independent: one all-to-all turns
(B, H, T/N, D) on every rank into (B, H/N, T, D), each rank attends over the whole sequence for
its H/N heads, and a second all-to-all turns the output back. Backward runs the two exchanges
the other way round. So N can be at most H (with grouped-query attention, at most the number of
key/value heads), which is the method's cap; ring attention has no such cap.

Bytes sent per rank per attention call (S = B·H·T_local·D elements of e bytes): an all-to-all
keeps 1/N of its input and sends the rest, so q, k, v in and the output back cost
4·(N-1)/N·S·e forward, and the same backward (`ulysses_attention_bytes`). Unlike the ring's,
that does not grow with N.

Invariant: the output and gradients equal single-process attention over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_lab import comms
from parallel_lab.context_parallel.inputs import agree_on_inputs


def _seq_to_heads(ctx, x: torch.Tensor, group) -> torch.Tensor:
    """(..., H, T/N, D) on every rank -> (..., H/N, T, D): rank j gets head group j of every chunk."""
    p, _ = comms.group_size_rank(ctx, group)
    parts = [t.contiguous() for t in x.chunk(p, dim=-3)]  # p x (..., H/N, T/N, D): head group j -> rank j
    got = comms.all_to_all(ctx, parts, group=group)  # got[j]: rank j's sequence chunk of my head group
    return torch.cat(got, dim=-2)  # (..., H/N, T, D), chunks in sequence order


def _heads_to_seq(ctx, x: torch.Tensor, group) -> torch.Tensor:
    """The inverse: (..., H/N, T, D) -> (..., H, T/N, D)."""
    p, _ = comms.group_size_rank(ctx, group)
    parts = [t.contiguous() for t in x.chunk(p, dim=-2)]  # sequence chunk j -> rank j
    got = comms.all_to_all(ctx, parts, group=group)  # got[j]: head group j of my sequence chunk
    return torch.cat(got, dim=-3)  # (..., H, T/N, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, group):
        fctx.cp = (ctx, group)
        return _seq_to_heads(ctx, x, group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group = fctx.cp
        return _heads_to_seq(ctx, grad, group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, group):
        fctx.cp = (ctx, group)
        return _heads_to_seq(ctx, x, group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group = fctx.cp
        return _seq_to_heads(ctx, grad, group), None, None


def ulysses_attention(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      group=None) -> torch.Tensor:  # fmt: skip
    """This rank's part of attention over the whole sequence, by two all-to-alls around local attention.

    q, k, v (B, H, T_local, D), contiguous layout (`shard_sequence(..., zigzag=False)`); H must be
    divisible by the group size. Returns (B, H, T_local, D). Differentiable."""
    agree_on_inputs(ctx, "ulysses_attention", q, k, v, group, causal=causal, zigzag=False, split_heads=True)
    qkv = _SeqToHeads.apply(
        torch.stack([q, k, v]), ctx, group
    )  # (3, B, H/N, T, D): one exchange for all three
    with ctx.recorder.span("ulysses attention", kind="compute"):
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=bool(causal))  # (B, H/N, T, D)
    return _HeadsToSeq.apply(o, ctx, group)  # (B, H, T_local, D)


__all__ = ["ulysses_attention"]
