"""Checks for lesson 17's exercises: the online-softmax merge of two partial attention results, and
the zigzag layout of a sequence over the ranks of a context-parallel group.

`merge(out_a, lse_a, out_b, lse_b)` is fed partial results computed here over disjoint blocks of
keys (two blocks, then a chain of four, then blocks a query cannot see at all) and compared with
attention over the union in float64; the scores pass 100 so that a merge which exponentiates a
log-sum-exp without subtracting the larger one overflows. `zigzag_positions(rank, world_size,
seq_len)` is compared with the layout the lab's ring attention uses, for 1 to 8 ranks and on
layouts drawn at random each run (up to 16 ranks), and must reject a length the layout cannot split.
Shapes, splits and values of the merge cases are drawn each run too, so a table of one run's answers
fails the next. While the learner's function runs, the lab's implementations and torch's own
(context parallelism's load balancers and its partial-attention merger, private to torch) are off.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

#: torch's context parallelism (private: torch.distributed.tensor.experimental), where a load
#: balancer lays out the zigzag and _SDPAMerger merges partial attention results
TORCH_CP = family(
    "torch.distributed.tensor.experimental._context_parallel._load_balancer",
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
    missing_ok=True,
)
_SDPA = "merge the two partial results yourself"
FORBIDDEN = {
    **family("parallel_lab.inference.attention", "parallel_lab.context_parallel.ring"),
    **TORCH_CP,
    "torch.nn.functional.scaled_dot_product_attention": _SDPA,
    "torch._C._nn.scaled_dot_product_attention": _SDPA,
}
LAYOUT_FORBIDDEN = {**family("parallel_lab.context_parallel.layout"), **TORCH_CP}

__all__ = ["check_merge_partials", "check_zigzag_positions"]


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None):
    """(out, lse) of softmax attention of q over these keys only, in float64 then float32."""
    s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, n, m)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, n)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return (p @ v.double()).float(), lse.float()


def _call(fn, a, b, what: str):
    got = fn(a[0].clone(), a[1].clone(), b[0].clone(), b[1].clone())
    ok = isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)
    assert ok, f"{what}: return (out, lse), two tensors; got {type(got).__name__}"
    out, lse = got
    assert out.shape == a[0].shape and lse.shape == a[1].shape, (
        f"{what}: out must keep the shape {tuple(a[0].shape)} and lse {tuple(a[1].shape)}; got "
        f"{tuple(out.shape)} and {tuple(lse.shape)}"
    )
    return out, lse


def _compare(out, lse, want_out, want_lse, what: str) -> None:
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError(
            f"{what}: your result holds inf or nan where every value is finite. exp() of a log-sum-exp near "
            "100 overflows float32 (exp(89) > 3.4e38): exponentiate only differences from the larger of the two"
        )
    err_lse = (lse.double() - want_lse.double()).abs().max().item()
    assert err_lse <= 1e-3, (
        f"{what}: lse differs from the log-sum-exp over both blocks by up to {err_lse:.3g}: the union's "
        "total mass is the sum of the two parts' masses, exp(lse_a) + exp(lse_b), kept in log space"
    )
    err = (out.double() - want_out.double()).abs().max().item()
    assert err <= 1e-4, (
        f"{what}: out differs from attention over both blocks by up to {err:.3g} (expected: each part "
        "rescaled by its share of the union's softmax mass, exp(lse_x - lse), then added)"
    )


def check_merge_partials(merge: Callable) -> None:
    """`merge(out_a, lse_a, out_b, lse_b)` -> (out, lse): attention over the union of two blocks of keys."""
    require_callable(merge, "merge")
    fn = guarded(merge, FORBIDDEN, "this exercise (merge)")
    rnd = random.Random(draw_seed())
    g = torch.Generator().manual_seed(rnd.getrandbits(62))
    cases = 0
    top = 0.0
    # shapes, the split of the keys and the values drawn this run; the last scale pushes scores past 88,
    # where exp() overflows float32
    shapes = [(rnd.randint(1, 3), rnd.randint(1, 4), rnd.randint(1, 9), rnd.choice((4, 8, 16)), s)
              for s in (1.0, 3.0, 60.0)]  # fmt: skip
    for B, H, n, d, scale in shapes:
        m = rnd.randint(6, 16)  # keys
        cut = rnd.randint(1, m - 1)
        q = torch.randn(B, H, n, d, generator=g) * scale
        k, v = torch.randn(B, H, m, d, generator=g), torch.randn(B, H, m, d, generator=g)
        big = (q @ k.transpose(-2, -1) / math.sqrt(d)).abs().max().item()
        top = max(top, big)
        want = _partial(q, k, v)
        a, b = _partial(q, k[:, :, :cut], v[:, :, :cut]), _partial(q, k[:, :, cut:], v[:, :, cut:])
        what = f"merge of keys 0-{cut - 1} and {cut}-{m - 1} (B={B}, H={H}, {n} queries, d={d}, scores up to {big:.0f})"
        _compare(*_call(fn, a, b, what), *want, what)
        bounds = sorted(rnd.sample(range(1, m), 3))  # a chain of four blocks, as a ring of 4 ranks merges
        edges = [0, *bounds, m]
        out, lse = _partial(q, k[:, :, : edges[1]], v[:, :, : edges[1]])
        for lo, hi in zip(edges[1:], edges[2:]):
            out, lse = _call(fn, (out, lse), _partial(q, k[:, :, lo:hi], v[:, :, lo:hi]), what)
        _compare(
            out, lse, *want, f"four blocks of keys (cut at {bounds}) merged one after another ({what[9:]})"
        )
        b_first = _call(fn, b, a, what)
        _compare(*b_first, *want, f"the same blocks in the other order ({what[9:]})")
        cases += 3
    # a block no query sees (a causal mask's future): out 0, lse -inf, and it must change nothing
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    seen = _partial(q, k, v)
    hidden = _partial(q, k, v, torch.zeros(4, 4, dtype=torch.bool))
    what = "a block whose keys no query may see (its out is 0 and its lse is -inf) merged with a visible one"
    _compare(*_call(fn, seen, hidden, what), *seen, what)
    passed("check_merge_partials", f"{cases + 1} cases drawn this run, scores past 88 in the last three")


def _zigzag(rank: int, n: int, length: int) -> list[int]:
    c = length // (2 * n)
    return [*range(rank * c, (rank + 1) * c), *range((2 * n - 1 - rank) * c, (2 * n - rank) * c)]


def check_zigzag_positions(zigzag_positions: Callable) -> None:
    """`zigzag_positions(rank, world_size, seq_len)` -> the positions rank holds, chunks r and 2N-1-r, in order."""
    require_callable(zigzag_positions, "zigzag_positions")
    fn = guarded(zigzag_positions, LAYOUT_FORBIDDEN, "this exercise (zigzag_positions)")
    rnd = random.Random(draw_seed())
    fixed = [(n, length, rank) for n in range(1, 9) for length in (2 * n, 4 * n) for rank in range(n)]
    drawn = []
    for _ in range(24):  # layouts no table of an earlier run holds: up to 16 ranks, chunks of up to 64
        n = rnd.randint(2, 16)
        drawn.append((n, 2 * n * rnd.randint(3, 64), rnd.randrange(n)))
    for n, length, rank in fixed + drawn:
        got = fn(rank, n, length)
        got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        want = _zigzag(rank, n, length)
        where = f"zigzag_positions(rank={rank}, world_size={n}, seq_len={length})"
        if got == want:
            continue
        c = length // (2 * n)
        if sorted(got) == sorted(want):
            hint = f" holds the right tokens in the wrong order: the early chunk ({rank}) comes first"
        elif got == [*range(rank * c, (rank + 1) * c), *range((n + rank) * c, (n + rank + 1) * c)]:
            hint = (f": that pairs chunk {rank} with chunk N + {rank} = {n + rank}; the partner that balances "
                    f"a causal mask is chunk 2N-1-{rank} = {2 * n - 1 - rank}")  # fmt: skip
        else:
            hint = f": expected chunks {rank} and {2 * n - 1 - rank} of {2 * n} chunks of {c} tokens"
        shown = want if len(want) <= 16 else f"{want[:8]} ... {want[-8:]}"
        raise AssertionError(f"{where} returned {got if len(got) <= 16 else '...'}, expected {shown}{hint}")
    for n, length in ((4, 12), (3, 9), (2, 6)):
        try:
            fn(0, n, length)
        except ValueError:
            continue
        raise AssertionError(
            f"zigzag_positions(0, {n}, {length}) returned instead of raising ValueError: {length} tokens do not "
            f"split into 2 x {n} = {2 * n} equal chunks"
        )
    passed(
        "check_zigzag_positions",
        f"{len(fixed)} fixed layouts, {len(drawn)} drawn this run, 3 lengths that cannot split",
    )
