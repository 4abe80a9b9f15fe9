"""Checks for lesson 14's exercises: sliding-window attention with a rolling KV cache, and causal online-softmax
attention that also returns each query's log-sum-exp.

`rolling_cached_attention(q, k_new, v_new, cache, window)` is run on a prefill longer than the window, decode steps
and a chunk of several tokens, against a reference computed here from the whole sequence with the window's mask;
the cache must never hold more than `window` positions (Jiang et al. 2023, Mistral 7B, "rolling buffer cache").
`online_softmax_attention(q, k, v, block)` returns (out, lse) for queries at the last N of M positions, causal,
compared with softmax attention and torch.logsumexp on the masked scores (FlashAttention-2 keeps lse for its
backward), on scores large enough that exp() overflows unless the running maximum is subtracted; no tensor as
large as a quarter of the N x M score matrix may be created while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

_SDPA = "write the attention yourself: scores, mask, softmax, weighted sum"
FORBIDDEN = {
    **family(
        "parallel_lab.inference.attention", "parallel_lab.inference.kv_cache", "parallel_lab.inference.paged"
    ),
    "torch.nn.functional.scaled_dot_product_attention": _SDPA,
    "torch._C._nn.scaled_dot_product_attention": _SDPA,
}

__all__ = ["check_online_softmax_attention", "check_rolling_cached_attention"]


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None = None,
    lse: bool = False,
):
    """Queries at positions start.. over keys 0..start+t-1, causal (and within `window` positions, its own
    included), in float64; with `lse`, also each query's log-sum-exp of its visible scores."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    t, L = s.shape[-2:]
    qpos, kpos = torch.arange(start, start + t)[:, None], torch.arange(L)[None, :]
    allowed = kpos <= qpos  # (t, L)
    if window is not None:
        allowed &= kpos > qpos - window
    s = s.masked_fill(~allowed, float("-inf"))
    out = (s.softmax(-1) @ v.double()).float()
    return (out, torch.logsumexp(s, -1).float()) if lse else out


def check_rolling_cached_attention(fn: Callable) -> None:
    """`fn(q, k_new, v_new, cache, window)`: attend causally within the last `window` positions (its own included),
    keeping at most `window` positions of keys and values in `cache` between calls."""
    require_callable(fn, "rolling_cached_attention")
    fn = guarded(fn, FORBIDDEN, "this exercise (rolling_cached_attention)")
    g = torch.Generator().manual_seed(
        draw_seed()
    )  # queries, keys, values and one schedule drawn afresh every run
    rnd_chunk = int(torch.randint(2, 5, (1,), generator=g))
    for window, steps in (
        (4, (("a prefill of 7 tokens, longer than the window", 7), ("a decode step", 1), ("a decode step", 1),
             (f"a chunk of {rnd_chunk} tokens", rnd_chunk), ("a decode step", 1))),
        (6, (("a prefill of 2 tokens", 2), ("a decode step", 1), ("a chunk of 5 tokens", 5),
             ("a decode step", 1), ("a chunk of 9 tokens", 9), ("a decode step", 1))),
        (1, (("a prefill of 3 tokens", 3), ("a decode step", 1))),
    ):  # fmt: skip
        B, H, d = 2, 3, 8
        T = sum(t for _, t in steps)
        q_all, k_all, v_all = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
        cache: dict = {"k": None, "v": None, "seen": 0}
        start = 0
        for what, t in steps:
            where = f"window={window}, {what} at positions {start}..{start + t - 1}"
            sl = slice(start, start + t)
            try:
                out = fn(q_all[:, :, sl], k_all[:, :, sl], v_all[:, :, sl], cache, window)
            except NotImplementedError:
                raise
            except Exception as e:
                raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
            want = _reference(
                q_all[:, :, sl], k_all[:, :, : start + t], v_all[:, :, : start + t], start, window
            )
            assert isinstance(out, torch.Tensor) and out.shape == want.shape, (
                f"{where}: expected an output of shape {tuple(want.shape)}, got "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
            )
            held = [v for v in cache.values() if isinstance(v, torch.Tensor) and v.dim() == 4]
            big = max((v.shape[2] for v in held), default=0)
            assert held and big <= window, (
                f"{where}: after the call the cache holds tensors of {big} positions; a rolling cache keeps at most "
                f"window={window} positions of keys and values"
            )
            err = (out - want).abs().max().item()
            if not err <= 1e-5:  # nan too
                rows = (out - want).abs().amax(dim=(0, 1, 3))
                bad = int(rows.argmax())
                p = start + bad
                raise AssertionError(
                    f"{where}: output differs by {err:.3g} at new token {bad} (position {p}); it must attend to the "
                    f"keys of positions {max(0, p - window + 1)}..{p}"
                )
            start += t
    passed("check_rolling_cached_attention", "3 windows: prefills longer than the window, steps and chunks")


class _Biggest(TorchDispatchMode):
    """Remembers the largest tensor any operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _check_out_lse(what: str, got, want: tuple[torch.Tensor, torch.Tensor], tol: float) -> None:
    assert isinstance(got, (tuple, list)) and len(got) == 2, (
        f"{what}: return (out, lse), got {type(got).__name__}"
    )
    out, lse = got
    for name, g, w in (("out", out, want[0]), ("lse", lse, want[1])):
        assert isinstance(g, torch.Tensor) and g.shape == w.shape, (
            f"{what}: {name} should have shape {tuple(w.shape)}, got "
            f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}"
        )
        err = (g.double() - w.double()).abs().max().item()
        assert err < tol, f"{what}: {name} differs from the masked softmax attention's by {err:.3g}"


def check_online_softmax_attention(online_softmax_attention: Callable) -> None:
    """`online_softmax_attention(q, k, v, block)` -> (out, lse): queries at the last N of M positions, causal,
    keys taken `block` at a time; out == softmax(masked q k^T / sqrt(d)) v, lse == logsumexp of those scores."""
    require_callable(online_softmax_attention, "online_softmax_attention")
    fn = guarded(online_softmax_attention, FORBIDDEN, "this exercise (online_softmax_attention)")
    g = torch.Generator().manual_seed(draw_seed())  # every tensor drawn afresh every grade run
    cases = [
        ("N = M = 64, block 16 (a prefill)", (1, 2, 64, 8), (1, 2, 64, 8), 16),
        (
            "N = 10 queries at the end of M = 37 keys, block 8 (a short last block)",
            (2, 1, 10, 4),
            (2, 1, 37, 4),
            8,
        ),
        ("one query, M = 3, block 16 (a decode step)", (1, 1, 1, 4), (1, 1, 3, 4), 16),
        ("N = 5 of M = 5, block 1", (1, 1, 5, 4), (1, 1, 5, 4), 1),
    ]
    for what, qs, ks, block in cases:
        q, k, v = torch.randn(*qs, generator=g), torch.randn(*ks, generator=g), torch.randn(*ks, generator=g)
        got = fn(q, k, v, block)
        _check_out_lse(what, got, _reference(q, k, v, ks[2] - qs[2], lse=True), 1e-5)
    # scores around 1,000: exp() overflows float32 (above 88) unless the running maximum is subtracted
    q, k, v = (
        torch.randn(1, 1, 32, 8, generator=g),
        torch.randn(1, 1, 48, 8, generator=g),
        torch.randn(1, 1, 48, 8, generator=g),
    )
    q[..., 0], k[..., 0] = 53.0, 53.0  # every score of a row shifted by the same ~990
    got = fn(q, k, v, 8)
    assert isinstance(got, (tuple, list)) and len(got) == 2 and torch.isfinite(got[0]).all(), (
        "with scores near 1,000 your output has inf or nan: exp(1000) overflows; subtract the running maximum "
        "before exponentiating"
    )
    _check_out_lse("with large scores (all shifted by the same ~990)", got,
                   _reference(q.double(), k.double(), v, 16, lse=True), 1e-3)  # fmt: skip
    # memory: nothing near the (N x M) score matrix
    B, H, N, M, d, block = 1, 2, 512, 512, 16, 64
    q, k, v = (torch.randn(B, H, s, d, generator=g) for s in (N, M, M))
    with _Biggest() as big:
        fn(q, k, v, block)
    limit = B * H * N * M // 4
    assert big.numel < limit, (
        f"N = M = {N}, block {block}: an operator ({big.op}) created a tensor of {big.numel:,} numbers, "
        f"{big.numel / (B * H * N * M):.0%} of the whole score matrix: take the keys {block} at a time and keep only "
        "running statistics"
    )
    passed(
        "check_online_softmax_attention",
        "4 causal shapes, overflowing scores, out and lse, largest temporary under a quarter of N x M",
    )
