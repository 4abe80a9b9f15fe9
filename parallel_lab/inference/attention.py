"""Attention for inference: the plain N x N version, and the tiled one that never builds it.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
Milakov & Gimelshein 2018 for the online softmax it rests on. softmax(s)·V over a row of scores s
can be computed one block of keys at a time: keep the running maximum m, the running sum of
exp(s - m) and the running weighted sum of values; when a later block raises the maximum, rescale
what was kept by exp(m_old - m_new). The result is exact (up to rounding), and the largest
temporary is one (block_q x block_k) tile of scores instead of the (N x N) matrix: memory O(N)
instead of O(N^2), the same trade selective recomputation makes in training (the scores are
recomputed in backward instead of stored).

`causal_attention` is what the lab's serving model calls: queries at absolute positions
start .. start+t-1 against keys 0 .. start+t-1 (a KV cache holds the first `start`), with
grouped-query key/value heads shared by n_heads / kv_heads query heads.

Invariant: `flash_attention(q, k, v, causal)` equals `naive_attention(q, k, v, causal)` and
torch's `scaled_dot_product_attention` within float32 rounding (tests: 1e-5), and allocates no
tensor of N x N scores.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "attention_lse",
    "causal_attention",
    "flash_attention",
    "merge_attention",
    "naive_attention",
    "repeat_kv",
]


def repeat_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, L, hd) -> (B, kv_heads * groups, L, hd): each key/value head serves `groups` query heads."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions start..start+t-1 over keys 0..start+t-1, causal.

    q (B, nh, t, hd); k, v (B, kvh, start+t, hd) with nh a multiple of kvh. Returns (B, nh, t, hd).
    """
    t, L = q.shape[2], k.shape[2]
    if L != start + t:
        raise ValueError(f"keys cover {L} positions, expected start + t = {start} + {t}")
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, nh, L, hd)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, t, L)
    # query i sits at position start + i: it sees keys j <= start + i
    mask = torch.ones(t, L, dtype=torch.bool, device=q.device).triu(start + 1)  # (t, L)
    att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
    return att @ v  # (B, nh, t, hd)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with the whole (B, H, N, N) score matrix in memory."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, N, N)
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1), float("-inf"))
    return F.softmax(s, dim=-1) @ v  # (B, H, N, hd)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block of attention and its log-sum-exp, the partial result that `merge_attention` combines.

    q (B, H, n, d), k and v (B, H, m, d). With `causal_offset` c, query i sees key j only when
    j <= i + c (None: every key). Returns (out, lse) in float32 (low-precision inputs are
    accumulated in float32, as FlashAttention does): out (B, H, n, d) is softmax attention over
    this block's keys alone, lse (B, H, n) = log sum_j exp(s_ij). A row that sees no key of the
    block gets out 0 and lse -inf, which the merge gives weight 0.
    """
    f32 = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(f32) @ k.to(f32).transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, n, m)
    if causal_offset is not None:
        n, m = s.shape[-2:]
        hidden = (
            torch.arange(m, device=q.device)[None, :]
            > torch.arange(n, device=q.device)[:, None] + causal_offset
        )
        s = s.masked_fill(hidden, float("-inf"))  # (B, H, n, m)
    mx = s.amax(dim=-1, keepdim=True)  # (B, H, n, 1)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)  # a row with no key: exp(-inf - 0) = 0
    p = torch.exp(s - mx)  # (B, H, n, m), every entry <= 1: no overflow however large the scores
    total = p.sum(dim=-1, keepdim=True)  # (B, H, n, 1)
    out = (p @ v.to(f32)) / torch.where(total > 0, total, torch.ones_like(total))  # (B, H, n, d)
    return out, (mx + torch.log(total)).squeeze(-1)  # lse (B, H, n); log(0) = -inf for an empty row


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Combine attention over two disjoint sets of keys into attention over their union.

    out_x (..., n, d) is softmax attention over key set x, lse_x (..., n) its log-sum-exp. The
    union's softmax weights each part by its share of the total mass: exp(lse_x - lse), with
    lse = log(exp(lse_a) + exp(lse_b)) computed stably (logaddexp subtracts the larger one), so
    nothing overflows however large the scores. The online softmax of FlashAttention (tiles of one
    sequence) and ring attention (blocks of keys arriving from other ranks) are this one step.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (..., n)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both parts empty: weights 0, not nan
    wa, wb = torch.exp(lse_a - ref).unsqueeze(-1), torch.exp(lse_b - ref).unsqueeze(-1)  # (..., n, 1)
    return out_a * wa + out_b * wb, lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:  # fmt: skip
    """The same result as `naive_attention`, one (block_q x block_k) tile of scores at a time.

    q (B, H, N, d), k and v (B, H, M, d); with `causal`, query i sees keys j <= i + M - N (the
    queries are the last N positions). The forward pass of FlashAttention, in PyTorch ops: each
    tile's partial result (`attention_lse`) is folded into the running one by `merge_attention`.
    """
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    N, M = q.shape[2], k.shape[2]
    out = torch.empty_like(q)  # (B, H, N, d)
    for i0 in range(0, N, block_q):
        qi = q[:, :, i0 : i0 + block_q]  # (B, H, bq, d)
        bq = qi.shape[2]
        acc = lse = None
        last = M if not causal else min(M, i0 + bq + M - N)  # keys past the last query's position: skipped
        for j0 in range(0, last, block_k):
            # query i0+i sits at position i0+i+M-N; key j0+j is visible when j0+j <= that
            offset = i0 + M - N - j0 if causal else None
            o, l = attention_lse(qi, k[:, :, j0 : j0 + block_k], v[:, :, j0 : j0 + block_k], offset)  # noqa: E741
            acc, lse = (o, l) if acc is None else merge_attention(acc, lse, o, l)  # (B, H, bq, d), (B, H, bq)
        out[:, :, i0 : i0 + bq] = acc
    return out
