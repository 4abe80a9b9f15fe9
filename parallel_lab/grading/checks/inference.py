"""Checks for lesson 14's exercises: the attention step of a KV-cached decoder, and online-softmax attention.

`cached_attention(q, k_new, v_new, cache)` is run on a prefill, single-token decode steps and a
chunk of several new tokens after a prefill (where a causal mask that is not shifted by the
number of cached tokens goes wrong), against a reference computed here from the whole sequence;
then it drives greedy generation of a small GPT, whose tokens must equal generation without a
cache. `online_softmax_attention(q, k, v, block)` is compared with softmax attention, on scores
large enough that exp() overflows unless the running maximum is subtracted, and no tensor as
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

__all__ = ["check_cached_attention", "check_online_softmax_attention"]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions start.. over keys 0..start+t-1, causal, in float64."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    t, L = s.shape[-2:]
    allowed = torch.arange(L)[None, :] <= torch.arange(start, start + t)[:, None]  # (t, L)
    return (s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()).float()


def check_cached_attention(cached_attention: Callable) -> None:
    """`cached_attention(q, k_new, v_new, cache)`: append to cache["k"], cache["v"]; attend causally."""
    require_callable(cached_attention, "cached_attention")
    fn = guarded(cached_attention, FORBIDDEN, "this exercise (cached_attention)")
    g = torch.Generator().manual_seed(draw_seed())  # queries, keys and values drawn afresh every grade run
    B, H, d, T = 2, 3, 8, 12
    q_all, k_all, v_all = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
    cache = {"k": None, "v": None}
    start = 0
    for what, t in (("the prefill (5 tokens, empty cache)", 5), ("a decode step (1 token)", 1),
                    ("a decode step (1 token)", 1), ("a chunk of 3 tokens after 7 cached", 3),
                    ("a decode step (1 token)", 1)):  # fmt: skip
        sl = slice(start, start + t)
        out = fn(q_all[:, :, sl], k_all[:, :, sl], v_all[:, :, sl], cache)
        want = _reference(q_all[:, :, sl], k_all[:, :, : start + t], v_all[:, :, : start + t], start)
        assert isinstance(out, torch.Tensor) and out.shape == want.shape, (
            f"{what}: expected an output of shape {tuple(want.shape)}, got "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
        )
        for name, full in (("k", k_all), ("v", v_all)):
            got = cache.get(name)
            assert isinstance(got, torch.Tensor) and got.shape[2] == start + t, (
                f"after {what} cache[{name!r}] should hold {start + t} positions (dim 2), got "
                f"{None if not isinstance(got, torch.Tensor) else tuple(got.shape)}: append the new keys and values"
            )
            assert torch.equal(got, full[:, :, : start + t]), (
                f"after {what} cache[{name!r}] does not hold the keys/values of positions 0..{start + t - 1} in order"
            )
        err = (out - want).abs().max().item()
        if not err <= 1e-5:  # nan too
            rows = (out - want).abs().amax(dim=(0, 1, 3))
            bad = int(rows.argmax())
            raise AssertionError(
                f"{what}: output differs by {err:.3g} at new token {bad} (position {start + bad}); it must "
                f"attend to the keys of positions 0..{start + bad}, its own included, and no later ones"
            )
        start += t
    n = _generation_agrees(fn)
    passed("check_cached_attention", f"prefill, decode steps and a 3-token chunk; {n} generated tokens equal")


def _generation_agrees(fn: Callable) -> int:
    from parallel_lab.inference import NoCache, ServingGPT, generate
    from parallel_lab.models import GPTConfig, build_model

    class LearnerCache:
        """The serving model's cache interface, with the learner's function doing the attention."""

        def __init__(self) -> None:
            self.layers: dict[int, dict] = {}
            self.length = 0

        def positions(self, batch: int, t: int, device) -> torch.Tensor:
            return torch.arange(self.length, self.length + t, device=device).expand(batch, t)

        def attend(self, layer: int, q, k, v):
            return fn(q, k, v, self.layers.setdefault(layer, {"k": None, "v": None}))

        def advance(self, t: int) -> None:
            self.length += t

    model = ServingGPT.from_gpt(
        build_model(GPTConfig(vocab=64, seq_len=32, d_model=32, n_heads=4, n_layers=2), 3)
    )
    prompt = torch.randint(64, (2, 4), generator=torch.Generator().manual_seed(draw_seed()))  # drawn per run
    want = generate(model, prompt, 16, NoCache())
    got = generate(model, prompt, 16, LearnerCache())
    diff = (got != want).nonzero()
    assert not len(diff), (
        f"generation with your cache differs from generation without one first at sequence {int(diff[0, 0])}, "
        f"position {int(diff[0, 1])}: {got[int(diff[0, 0])].tolist()} vs {want[int(diff[0, 0])].tolist()}"
    )
    return 2 * 16


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


def check_online_softmax_attention(online_softmax_attention: Callable) -> None:
    """`online_softmax_attention(q, k, v, block)` == softmax(q k^T / sqrt(d)) v, keys taken `block` at a time."""
    require_callable(online_softmax_attention, "online_softmax_attention")
    fn = guarded(online_softmax_attention, FORBIDDEN, "this exercise (online_softmax_attention)")
    g = torch.Generator().manual_seed(draw_seed())  # every tensor drawn afresh every grade run
    cases = [
        ("N = M = 64, block 16", (1, 2, 64, 8), (1, 2, 64, 8), 16),
        ("N = 10 queries, M = 37 keys, block 8 (the last block is short)", (2, 1, 10, 4), (2, 1, 37, 4), 8),
        ("block larger than M", (1, 1, 5, 4), (1, 1, 3, 4), 16),
    ]
    for what, qs, ks, block in cases:
        q, k, v = torch.randn(*qs, generator=g), torch.randn(*ks, generator=g), torch.randn(*ks, generator=g)
        out = fn(q, k, v, block)
        want = _reference(q, k, v, ks[2])  # start = M: every query sees every key
        assert isinstance(out, torch.Tensor) and out.shape == want.shape, (
            f"{what}: expected shape {tuple(want.shape)}, got "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
        )
        err = (out - want).abs().max().item()
        assert err < 1e-5, (
            f"{what}: output differs from softmax attention by {err:.3g}; when a block raises the running "
            "maximum, what was summed so far must be rescaled"
        )
    # scores around 1,000: exp() overflows float32 (above 88) unless the running maximum is subtracted
    q, k, v = (
        torch.randn(1, 1, 32, 8, generator=g),
        torch.randn(1, 1, 48, 8, generator=g),
        torch.randn(1, 1, 48, 8, generator=g),
    )
    q[..., 0], k[..., 0] = 53.0, 53.0  # every score of a row shifted by the same ~990
    out = fn(q, k, v, 8)
    assert torch.isfinite(out).all(), (
        "with scores near 1,000 your output has inf or nan: exp(1000) overflows; subtract the running maximum "
        "before exponentiating"
    )
    err = (out - _reference(q.double(), k.double(), v, 48)).abs().max().item()
    assert err < 1e-3, f"with large scores (all shifted by the same ~990) the output differs by {err:.3g}"
    # memory: nothing near the (N x M) score matrix
    B, H, N, M, d, block = 1, 2, 512, 512, 16, 64
    q, k, v = (torch.randn(B, H, s, d, generator=g) for s in (N, M, M))
    with _Biggest() as big:
        out = fn(q, k, v, block)
    limit = B * H * N * M // 4
    assert big.numel < limit, (
        f"N = M = {N}, block {block}: an operator ({big.op}) created a tensor of {big.numel:,} numbers, "
        f"{big.numel / (B * H * N * M):.0%} of the whole score matrix: take the keys {block} at a time and keep only "
        "running statistics"
    )
    passed(
        "check_online_softmax_attention",
        "3 shapes, overflowing scores, largest temporary under a quarter of N x M",
    )
