"""Ring attention: each rank keeps its queries; key/value blocks travel around the ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context". With N ranks, at step s rank r attends its queries to the key/value block that
started on rank r - s, while that block is already on its way to rank r + 1 (the send of the
next block is posted before the compute and waited for after it, so the transfer hides behind
the math). Each block's partial result (output, log-sum-exp) is folded into the running one
by `merge_attention`, the same online-softmax step FlashAttention uses between tiles (lesson
14's `inference.attention`): after N steps every query has seen every key, exactly.

Causal masking works on chunks: a key chunk before the query chunk is fully visible, the same
chunk is the causal diagonal, a later one is skipped. With the contiguous layout rank 0 has one
diagonal block of work and rank N-1 has N-1 full blocks more; the zigzag layout (layout.py)
gives every rank the same work.

Backward (the same ring again): each rank recomputes a block's scores from its saved queries,
the block's keys and the saved log-sum-exp (no N x N matrix is ever stored), and adds its
contribution to that block's dK and dV. Those accumulators travel with their key/value block
around the ring and arrive home after the last step. Why they travel rather than being summed
at the end: a rank then never holds gradients for more than the one block it is working on,
so memory stays O(T / N) per rank; reducing full-size dK, dV at the end would need O(T).

Bytes sent per rank per attention call (S = B·H·T_local·D elements, e bytes each; dK and dV
travel in float32, f = 4): forward (N-1)·2·S·e; backward (N-1)·2·S·e for the blocks plus
N·2·S·f for the accumulators (`ring_attention_bytes`).

Invariant: the output and the gradients of q, k, v equal single-process attention over the
whole sequence (torch's scaled_dot_product_attention), up to float rounding.
"""

from __future__ import annotations

import math

import torch

from parallel_lab import comms
from parallel_lab.context_parallel.inputs import agree_on_inputs
from parallel_lab.context_parallel.layout import chunk_ids
from parallel_lab.inference import attention_lse, merge_attention


def block_pairs(q_chunks: list[int], k_chunks: list[int], causal: bool) -> list[tuple[int, int, int | None]]:
    """Which (query chunk a, key chunk b) pairs are computed, and the causal offset of each.

    Chunk ids are global (positions [id*c, (id+1)*c)). Not causal: every pair, no mask. Causal: a key
    chunk before the query chunk is fully visible (offset None), the same chunk is the diagonal
    (offset 0: query i sees keys j <= i), a later chunk is skipped."""
    out = []
    for a, qa in enumerate(q_chunks):
        for b, kb in enumerate(k_chunks):
            if not causal or kb < qa:
                out.append((a, b, None))
            elif kb == qa:
                out.append((a, b, 0))
    return out


def _visible(n: int, m: int, offset: int | None) -> int:
    """Score entries a block lets through: all n*m, or the n(n+1)/2 of a diagonal block."""
    return n * m if offset is None else n * (n + 1) // 2


def _ring_forward(ctx, q, k, v, causal, zigzag, group):
    p, me = comms.group_size_rank(ctx, group)
    nc = 2 if zigzag else 1
    qs = q.chunk(nc, dim=2)  # nc x (B, H, T_local/nc, D)
    acc: list = [None] * nc  # per query chunk: (out, lse) over the keys seen so far
    kv, spare = torch.stack([k, v]), None  # (2, B, H, T_local, D): one message per step
    for s in range(p):
        owner = (me - s) % p  # the rank this key/value block started on
        handle = None
        if s < p - 1:  # post the next block's transfer first: it runs while this block is computed
            spare = torch.empty_like(kv) if spare is None else spare
            handle = comms.isendrecv(ctx, kv, (me + 1) % p, spare, (me - 1) % p, group)
        pairs = block_pairs(chunk_ids(me, p, zigzag), chunk_ids(owner, p, zigzag), causal)
        n = qs[0].shape[2]
        with ctx.recorder.span("ring attention", kind="compute", step=s, block=comms.global_rank(ctx, group, owner),
                               scores=sum(_visible(n, n, off) for _, _, off in pairs)):  # fmt: skip
            ks, vs = kv[0].chunk(nc, dim=2), kv[1].chunk(nc, dim=2)
            for a, b, off in pairs:
                o, lse = attention_lse(qs[a], ks[b], vs[b], off)  # (B, H, c, D), (B, H, c)
                acc[a] = (o, lse) if acc[a] is None else merge_attention(*acc[a], o, lse)
        if handle is not None:
            handle.wait()
            kv, spare = spare, kv  # the block just received is next; the sent one's buffer is free again
    out = torch.cat([o for o, _ in acc], dim=2)  # (B, H, T_local, D) float32
    lse = torch.cat([lse for _, lse in acc], dim=2)  # (B, H, T_local)
    return out, lse


def _block_backward(q, k, v, do, lse, delta, offset, dq, dk, dv) -> None:
    """FlashAttention-2's backward for one block, recomputing its probabilities from the saved lse."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, n, m)
    if offset is not None:
        n, m = s.shape[-2:]
        hidden = (
            torch.arange(m, device=q.device)[None, :] > torch.arange(n, device=q.device)[:, None] + offset
        )
        s = s.masked_fill(hidden, float("-inf"))
    prob = torch.exp(s - lse.unsqueeze(-1))  # (B, H, n, m): softmax over the whole sequence's keys
    dv.add_(prob.transpose(-2, -1) @ do)  # (B, H, m, D)
    dp = do @ v.transpose(-2, -1)  # (B, H, n, m)
    ds = prob * (dp - delta.unsqueeze(-1))  # (B, H, n, m): softmax's backward, row by row
    dq.add_((ds @ k) * scale)  # (B, H, n, D)
    dk.add_((ds.transpose(-2, -1) @ q) * scale)  # (B, H, m, D)


def _ring_backward(ctx, dout, q, k, v, out, lse, causal, zigzag, group):
    p, me = comms.group_size_rank(ctx, group)
    nc = 2 if zigzag else 1
    f32 = torch.promote_types(q.dtype, torch.float32)
    q32, do32 = q.to(f32), dout.to(f32)
    delta = (do32 * out).sum(dim=-1)  # (B, H, T_local): rowsum(dO * O)
    qs, dos, lses, deltas = (t.chunk(nc, dim=2) for t in (q32, do32, lse, delta))
    dq = torch.zeros_like(q32)  # (B, H, T_local, D)
    dqs = dq.chunk(nc, dim=2)
    kv, spare = torch.stack([k, v]), None  # (2, B, H, T_local, D)
    dkv = torch.zeros(kv.shape, dtype=f32, device=kv.device)  # dK, dV of the block held now
    dspare = torch.empty_like(dkv) if p > 1 else None
    for s in range(p):
        owner = (me - s) % p
        handle = None
        if s < p - 1:
            spare = torch.empty_like(kv) if spare is None else spare
            handle = comms.isendrecv(ctx, kv, (me + 1) % p, spare, (me - 1) % p, group)
        pairs = block_pairs(chunk_ids(me, p, zigzag), chunk_ids(owner, p, zigzag), causal)
        with ctx.recorder.span("ring attention backward", kind="compute", step=s,
                               block=comms.global_rank(ctx, group, owner)):  # fmt: skip
            ks, vs = (t.to(f32).chunk(nc, dim=2) for t in kv)
            dks, dvs = dkv[0].chunk(nc, dim=2), dkv[1].chunk(nc, dim=2)
            for a, b, off in pairs:
                _block_backward(qs[a], ks[b], vs[b], dos[a], lses[a], deltas[a], off, dqs[a], dks[b], dvs[b])
        if handle is not None:
            handle.wait()
            kv, spare = spare, kv
        if p > 1:  # the accumulators follow their block (after the last step: home to its owner)
            comms.sendrecv(ctx, dkv, (me + 1) % p, dspare, (me - 1) % p, group)
            dkv, dspare = dspare, dkv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, group, causal, zigzag):
        out, lse = _ring_forward(ctx, q, k, v, causal, zigzag, group)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.cp = (ctx, group, causal, zigzag)
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        ctx, group, causal, zigzag = fctx.cp
        dq, dk, dv = _ring_backward(ctx, dout, q, k, v, out, lse, causal, zigzag, group)
        return dq, dk, dv, None, None, None, None


def ring_attention(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   zigzag: bool = False, group=None) -> torch.Tensor:  # fmt: skip
    """This rank's part of softmax(q k^T / sqrt(D)) v over the whole sequence, by ring attention.

    q, k, v (B, H, T_local, D) are this rank's parts as `shard_sequence(..., zigzag=zigzag)` lays
    them out over `group` (default: ctx.group, else the world). Returns (B, H, T_local, D) in the
    same layout. Differentiable. Every rank of the group must call it; bad or disagreeing inputs
    raise the same ValueError on every rank."""
    agree_on_inputs(ctx, "ring_attention", q, k, v, group, causal=causal, zigzag=zigzag, split_heads=False)
    return _RingAttention.apply(q, k, v, ctx, group, bool(causal), bool(zigzag))


__all__ = ["block_pairs", "ring_attention"]
