"""Checks for lesson 14's exercises: sliding-window attention with a rolling KV cache, and causal online-softmax
attention that also returns each query's log-sum-exp.

`rolling_cached_attention(q, k_new, v_new, cache, window)` is run on a prefill longer than the window, decode steps
and a chunk of several tokens, against a reference computed here from the whole sequence with the window's mask;
after every call, the tensors the cache holds (found in any nesting of lists, tuples, dicts and objects; counted by
their storages, since a slice keeps its whole storage alive) may hold at most 2 * B * H * window * d numbers, keys
and values of `window` positions (Jiang et al. 2023, Mistral 7B, "rolling buffer cache").
`online_softmax_attention(q, k, v, block)` returns (out, lse) for queries at the last N of M positions, causal,
compared with softmax attention and torch.logsumexp on the masked scores (FlashAttention-2 keeps lse for its
backward), on scores large enough that exp() overflows unless the running maximum is subtracted; on a drawn
N < M, no tensor as large as a quarter of the N x M score matrix may be created and no matrix product may take more
than `block` key positions at once.

Both run the learner's function under a dispatch mode that rejects torch's fused attention operators
(aten._scaled_dot_product_*, *flash_attention*, *efficient_attention*, ...) however they are reached.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_lab.grading.checks import (
    WriteItYourself,
    draw_seed,
    family,
    passed,
    require_callable,
    tensors_in,
    unavailable,
)

_SDPA = "write the attention yourself: scores, mask, softmax, weighted sum"
FORBIDDEN = {
    **family(
        "parallel_lab.inference.attention", "parallel_lab.inference.kv_cache", "parallel_lab.inference.paged"
    ),
    "torch.nn.functional.scaled_dot_product_attention": _SDPA,
    "torch._C._nn.scaled_dot_product_attention": _SDPA,
    "torch.nn.functional.multi_head_attention_forward": _SDPA,
    # torch's Python attention: the CPU flash decomposition (it returns out and lse), flex attention (eager, with
    # its higher-order operator) and the experimental quantized SDPA
    "torch._decomp.decompositions.scaled_dot_product_flash_attention_for_cpu": _SDPA,
    **family("torch.nn.attention.flex_attention", instead=_SDPA, missing_ok=True),
    "torch._higher_order_ops.flex_attention.flex_attention": _SDPA,
    **family("torch._higher_order_ops.flex_attention", instead=_SDPA, missing_ok=True),  # sdpa_dense: the math
    **family("torch.nn.attention.experimental._scaled_dot_product_attention_quantized", instead=_SDPA, missing_ok=True),
    # torch's private attention functions and operators, by name (composite ones decompose before a dispatch mode
    # sees them): torch._scaled_dot_product_attention_math, torch.ops.aten._scaled_dot_product_flash_attention, ...
    **{f"torch.{n}": _SDPA for n in dir(torch) if "attention" in n},
    **{f"torch.ops.aten.{n}": _SDPA for n in sorted({
        op.split("::")[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names()
        if op.startswith("aten::") and "attention" in op})},
}  # fmt: skip

__all__ = ["check_online_softmax_attention", "check_rolling_cached_attention"]

_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "dot", "mv", "addmv", "addbmm")


class _Watch(TorchDispatchMode):
    """Rejects torch's fused attention operators (however reached: torch.ops.aten... too); remembers the largest
    tensor any operator returns and the operand shapes of every matrix product."""

    def __init__(self, exercise: str) -> None:
        super().__init__()
        self.exercise = exercise
        self.numel, self.op = 0, ""
        self.products: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name:  # _scaled_dot_product_*, _flash_attention_*, _efficient_attention_*, ...
            raise WriteItYourself(
                f"{self.exercise} asks you to write this yourself: torch's operator {func} is switched off while "
                f"the check runs ({_SDPA})"
            )
        out = func(*args, **(kwargs or {}))
        if name in _PRODUCTS:
            a, b = (args[1], args[2]) if name.startswith("add") or name == "baddbmm" else args[:2]
            self.products.append((str(func), tuple(a.shape), tuple(b.shape)))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _watched(fn: Callable, exercise: str) -> Callable:
    """`fn` with the lab's attention and torch's SDPA switched off and torch's fused attention operators rejected;
    `call.watch` is the last call's _Watch."""

    def call(*args, **kwargs):
        call.watch = _Watch(exercise)
        with unavailable(FORBIDDEN, exercise), call.watch:
            return fn(*args, **kwargs)

    call.watch = _Watch(exercise)
    return call


def _held_numbers(cache) -> int:
    """Numbers held by the tensors in `cache`, counted by storage (a slice keeps all of its storage alive)."""
    storages = {}
    for t in tensors_in(cache):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes() // max(1, t.element_size())
    return sum(storages.values())


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
    fn = _watched(fn, "this exercise (rolling_cached_attention)")
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
                # copies: a new token's keys are tensors of their own, not views of the whole sequence
                out = fn(
                    q_all[:, :, sl].clone(), k_all[:, :, sl].clone(), v_all[:, :, sl].clone(), cache, window
                )
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
            held, limit = _held_numbers(cache), 2 * B * H * window * d
            assert held <= limit, (
                f"{where}: after the call the tensors in your cache hold {held:,} numbers ({held / (2 * B * H * d):g} "
                f"positions of keys and values, counted by storage: a slice keeps the whole tensor it was cut from); "
                f"a rolling cache keeps at most window={window} positions, {limit:,} numbers"
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
    fn = _watched(online_softmax_attention, "this exercise (online_softmax_attention)")
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
    # memory: nothing near the (N x M) score matrix, and no product over more than `block` keys; N and M drawn
    rnd = random.Random(int(torch.randint(0, 2**62, (1,), generator=g)))
    B, H, d, block = 1, 2, 16, 64
    N = rnd.randint(150, 250)
    M = rnd.choice([m for m in range(400, 601) if m % N and m != B * H * N])
    q, k, v = (torch.randn(B, H, s, d, generator=g) for s in (N, M, M))
    what = f"N = {N} queries at the end of M = {M} keys, block {block}"
    got = fn(q, k, v, block)
    _check_out_lse(what, got, _reference(q, k, v, M - N, lse=True), 1e-5)
    watch = fn.watch
    limit = B * H * N * M // 4
    assert watch.numel < limit, (
        f"{what}: an operator ({watch.op}) created a tensor of {watch.numel:,} numbers, "
        f"{watch.numel / (B * H * N * M):.0%} of the whole score matrix: take the keys {block} at a time and keep only "
        "running statistics"
    )
    for op, a, b in watch.products:
        # the dimensions a product may have: d, at most `block` keys, or the queries (all N, or N per batch entry)
        wide = [n for n in a[-2:] + b[-2:] if n > block and n != d and n % N]
        assert not wide, (
            f"{what}: a matrix product ({op}) took operands of shapes {a} and {b}: {wide[0]} key positions at once; "
            f"take the keys at most {block} at a time"
        )
    passed(
        "check_online_softmax_attention",
        "5 causal shapes, overflowing scores, out and lse, keys a block at a time",
    )
