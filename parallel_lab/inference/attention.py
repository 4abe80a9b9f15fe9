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

__all__ = ["causal_attention", "flash_attention", "naive_attention", "repeat_kv"]


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


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:  # fmt: skip
    """The same result as `naive_attention`, one (block_q x block_k) tile of scores at a time.

    q (B, H, N, d), k and v (B, H, M, d); with `causal`, query i sees keys j <= i + M - N (the
    queries are the last N positions). The forward pass of FlashAttention, in PyTorch ops.
    """
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    B, H, N, d = q.shape
    M = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)  # (B, H, N, d)
    for i0 in range(0, N, block_q):
        qi = q[:, :, i0 : i0 + block_q] * scale  # (B, H, bq, d)
        bq = qi.shape[2]
        m = torch.full((B, H, bq, 1), float("-inf"), dtype=q.dtype, device=q.device)  # running max
        l = torch.zeros(B, H, bq, 1, dtype=q.dtype, device=q.device)  # running sum of exp(s - m)  # noqa: E741
        acc = torch.zeros(B, H, bq, d, dtype=q.dtype, device=q.device)  # running sum of exp(s - m) v
        last = M if not causal else min(M, i0 + bq + M - N)  # keys past the last query's position: skipped
        for j0 in range(0, last, block_k):
            s = qi @ k[:, :, j0 : j0 + block_k].transpose(-2, -1)  # (B, H, bq, bk): one tile of scores
            if causal:
                rows = torch.arange(i0, i0 + bq, device=q.device)[:, None] + (
                    M - N
                )  # absolute query positions
                cols = torch.arange(j0, j0 + s.shape[-1], device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, H, bq, 1)
            p = torch.exp(s - m_new)  # (B, H, bq, bk), every entry <= 1
            fix = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            l = l * fix + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = acc * fix + p @ v[:, :, j0 : j0 + block_k]  # (B, H, bq, d)
            m = m_new
        out[:, :, i0 : i0 + bq] = acc / l
    return out
