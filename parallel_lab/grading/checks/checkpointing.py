"""Checks for lesson 07 (activation checkpointing): selective recomputation, where to cut unequal blocks,
and the peak of torch's checkpoint_sequential convention on unequal blocks.

Exercises 1 and 2, `check_selective_mlp(Function)`: `Function.apply(x, w1, w2)` computes the MLP
gelu(x w1^T) w2^T, keeps beyond its inputs only the first product h = x w1^T for backward (the memory-per-FLOP
trade-off of Korthikanti et al. 2022's selective recomputation, applied to an elementwise op: gelu(h) is as
large as h and costs almost nothing to rebuild from it, h costs a matmul), and backward returns the three
gradients with exactly four matrix products (none recomputes h). What it keeps is counted twice over: the
tensors autograd's saved-tensor hooks see, and every tensor stored on the context (ctx.a = ..., nested
containers too). Compared with autograd on the plain MLP in float64.

Exercise 3, `check_best_segments(fn)`: `fn(linears, segments)` cuts blocks that save `linears[i]` tensors each
into `segments` checkpointed runs (the last one too) with the smallest peak of saved tensors; the learner's cut
is run for real and its peak, counted by autograd's saved-tensor hooks, must equal the best cut's.

Exercise 4, `check_peak_saved(fn)`: `fn(layers, n, d, f, policy)` predicts the peak bytes of saved activations
of `layers` MLP blocks under the policy "none", "selective" or "full"; counted on real runs, exactly.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.grading.checks import (
    draw_seed,
    family,
    guarded,
    passed,
    require_callable,
    tensors_in,
    unavailable,
)

# The lab's recomputation and measurements, and torch's checkpointing (its selective-checkpoint API
# included), switched off while the learner's code runs.
FORBIDDEN = {
    **family("parallel_lab.checkpointing.recompute", "parallel_lab.checkpointing.measure"),
    **family("torch.utils.checkpoint", missing_ok=True),
}

__all__ = ["check_best_segments", "check_peak_saved", "check_selective_mlp"]


# ----------------------------------------------------------------------------- exercises 1 and 2
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "dot", "mv"}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _storages(ts) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts}


def check_selective_mlp(Function: type) -> None:
    """`Function.apply(x, w1, w2)` = gelu(x w1^T) w2^T, keeping only h = x w1^T beyond its inputs, four
    matrix products in backward, gradients equal to autograd's on the plain MLP."""
    require_callable(getattr(Function, "apply", None), "Function.apply")
    rnd = random.Random(draw_seed())  # shapes, weights and inputs drawn afresh every grade run
    for _ in range(3):
        n, d = rnd.randint(3, 12), rnd.randint(2, 10)
        f = rnd.choice((2, 3, 4)) * d
        g = torch.Generator().manual_seed(rnd.getrandbits(62))
        x = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
        w1 = torch.randn(f, d, generator=g, dtype=torch.float64, requires_grad=True)
        w2 = torch.randn(d, f, generator=g, dtype=torch.float64, requires_grad=True)
        gout = torch.randn(n, d, generator=g, dtype=torch.float64)
        ref = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
        h_ref = ref[0] @ ref[1].T  # (n, f)
        (torch.nn.functional.gelu(h_ref) @ ref[2].T).backward(gout)
        where = f"x of shape ({n}, {d}), w1 ({f}, {d}), w2 ({d}, {f})"
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(t)
            return t

        inputs = _storages((x, w1, w2))
        with unavailable(FORBIDDEN, "this exercise (SelectiveMLP)"):
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = Function.apply(x, w1, w2)
            except NotImplementedError:
                raise
            except Exception as e:
                raise AssertionError(f"{where}: forward raised {type(e).__name__}: {e}") from e
            assert isinstance(y, torch.Tensor) and y.shape == (n, d), (
                f"{where}: forward must return the ({n}, {d}) output, got {getattr(y, 'shape', type(y).__name__)}"
            )
            want = torch.nn.functional.gelu(h_ref.detach()) @ ref[2].detach().T
            assert torch.allclose(y.detach(), want, rtol=1e-12, atol=1e-12), (
                f"{where}: the output differs from gelu(x w1^T) w2^T"
            )
            # what the context holds as attributes (ctx.a = gelu(h)) is kept as surely as what it saves
            on_ctx = tensors_in(list(vars(y.grad_fn).values())) if y.grad_fn is not None else []
            extra = [t for t in saved + on_ctx if t.untyped_storage().data_ptr() not in inputs]
            extra_bytes = sum(
                t.untyped_storage().nbytes()
                for t in {t.untyped_storage().data_ptr(): t for t in extra}.values()
            )
            h_bytes = n * f * 8
            assert extra_bytes == h_bytes and all(torch.equal(t.detach(), h_ref.detach()) for t in extra), (
                f"{where}: besides its inputs your Function keeps {extra_bytes} bytes for backward (saved or stored "
                "on ctx); it should keep "
                f"exactly the first product x w1^T ({h_bytes} bytes) and nothing else"
                + (
                    ""
                    if all(t.shape == h_ref.shape for t in extra)
                    else " (a tensor of another shape is among them)"
                )
            )
            counter = _CountMatmuls()
            try:
                with counter:
                    y.backward(gout)
            except NotImplementedError:
                raise
            except Exception as e:
                raise AssertionError(f"{where}: backward raised {type(e).__name__}: {e}") from e
        for name, got, r in zip(("x", "w1", "w2"), (x, w1, w2), ref):
            assert got.grad is not None, (
                f"{where}: no gradient reached {name} (return one per input of forward)"
            )
            assert torch.allclose(got.grad, r.grad, rtol=1e-10, atol=1e-10), (
                f"{where}: the gradient of {name} differs from autograd's by {(got.grad - r.grad).abs().max():.3g}"
            )
        assert counter.count == 4, f"{where}: backward ran {counter.count} matrix products; " + (
            "four are enough" if counter.count > 4 else "three gradients of a two-matmul MLP need four"
        )
    passed("check_selective_mlp", "3 MLPs: one product kept, four products in backward, gradients equal")


# ----------------------------------------------------------------------------- exercises 3 and 4
def _stack(linears: list[int], hidden: int = 4) -> nn.Sequential:
    """Blocks of linears[i] Linear layers (ReLU between), each saving linears[i] tensors, its input included."""
    g = torch.Generator().manual_seed(0)
    blocks = []
    for k in linears:
        mods: list[nn.Module] = []
        for i in range(k):
            lin = nn.Linear(hidden, hidden)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(hidden, hidden, generator=g))
            mods.append(lin)
            if i < k - 1:
                mods.append(nn.ReLU())
        blocks.append(nn.Sequential(*mods))
    return nn.Sequential(*blocks)


def _measured_peak(linears: list[int], sizes: list[int], checkpoint_last: bool) -> int:
    """The most saved tensors alive at once, counted on a real forward and backward."""
    from parallel_lab.checkpointing import SavedTensorCounter, checkpoint

    model = _stack(linears)
    x = torch.randn(2, 4, requires_grad=True)
    with SavedTensorCounter(model.parameters()) as c:
        start = 0
        for k, size in enumerate(sizes):
            run = nn.Sequential(*list(model)[start : start + size])
            last = k == len(sizes) - 1
            x = run(x) if last and not checkpoint_last else checkpoint(run, x, params=list(run.parameters()))
            start += size
        x.sum().backward()
    return c.peak_count


def _cuts(n: int, segments: int):
    for bounds in itertools.combinations(range(1, n), segments - 1):
        edges = (0, *bounds, n)
        yield [b - a for a, b in zip(edges, edges[1:])]


def _peak_formula(linears: list[int], sizes: list[int]) -> int:
    """Recomputing segment j holds the inputs of the segments before it and everything segment j saves."""
    sums, start = [], 0
    for s in sizes:
        sums.append(sum(linears[start : start + s]))
        start += s
    return max(j + sums[j] for j in range(len(sizes)))


def check_best_segments(fn: Callable[[list, int], list]) -> None:
    """`fn(linears, segments)` -> `segments` segment sizes (consecutive blocks, summing to the block count) whose
    checkpointed run has the smallest possible peak of saved tensors, every segment checkpointed."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (best_segments)")
    rnd = random.Random(draw_seed())  # block lists drawn afresh every grade run
    cases = [
        # minimising the largest segment's sum picks [1, 1, 2] (peak 4); the best cut is [2, 1, 1] (peak 3)
        ([1, 2, 1, 1], 3),
        ([5] * 6, 3),
        ([1, 1, 1, 8, 1, 1, 1], 3),
        ([6, 1, 1, 1, 1, 1, 1], 2),
        ([2, 3], 2),
        ([4, 4, 4], 1),
    ]
    for _ in range(4):
        n = rnd.randint(5, 11)
        linears = [rnd.choice((1, 1, 2, 3, 5, 8)) for _ in range(n)]
        cases.append((linears, rnd.randint(2, min(5, n))))
    for linears, segments in cases:
        call = f"best_segments(linears={linears}, segments={segments})"
        try:
            sizes = fn(list(linears), segments)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
        ok = (
            isinstance(sizes, (list, tuple))
            and len(sizes) == segments
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
            and sum(sizes) == len(linears)
        )
        assert ok, (
            f"{call}: return {segments} positive segment sizes that add up to {len(linears)} blocks, got {sizes!r}"
        )
        best_sizes = min(_cuts(len(linears), segments), key=lambda s: _peak_formula(linears, s))
        best = _measured_peak(linears, best_sizes, True)
        assert best == _peak_formula(linears, best_sizes), "internal: the peak model disagrees with autograd"
        got = _measured_peak(linears, list(sizes), True)
        assert got == best, (
            f"{call}: your segments {list(sizes)} hold up to {got} saved tensors at once; another cut holds only {best}"
        )
    passed("check_best_segments", f"{len(cases)} stacks cut at the smallest peak, measured")


class _ReferenceSelective(torch.autograd.Function):
    """The check's own selective MLP (x and h kept), to measure that policy."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        h = x @ w1.T
        ctx.save_for_backward(x, w1, w2, h)
        return torch.nn.functional.gelu(h) @ w2.T

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, w2, h = ctx.saved_tensors
        with torch.enable_grad():
            h = h.detach().requires_grad_()
            a = torch.nn.functional.gelu(h)
        (grad_h,) = torch.autograd.grad(a, h, grad_y @ w2)
        return grad_h @ w1, grad_h.T @ x, grad_y.T @ a.detach()


def _measured_mlp_bytes(layers: int, n: int, d: int, f: int, policy: str) -> int:
    """The peak bytes of saved activations (weights excluded) over one forward and backward of the stack."""
    from parallel_lab.checkpointing import SavedTensorCounter, checkpoint

    g = torch.Generator().manual_seed(1)
    ws = [(torch.randn(f, d, generator=g, requires_grad=True), torch.randn(d, f, generator=g, requires_grad=True))
          for _ in range(layers)]  # fmt: skip
    x = torch.randn(n, d, generator=g, requires_grad=True)  # (n, d), float32
    params = [w for pair in ws for w in pair]
    with SavedTensorCounter(params) as c:
        for w1, w2 in ws:
            if policy == "none":
                x = torch.nn.functional.gelu(x @ w1.T) @ w2.T
            elif policy == "selective":
                x = _ReferenceSelective.apply(x, w1, w2)
            else:  # "full": the lesson's checkpoint, one per block
                x = checkpoint(
                    lambda t, w1=w1, w2=w2: torch.nn.functional.gelu(t @ w1.T) @ w2.T, x, params=[w1, w2]
                )
        x.sum().backward()
    return c.peak_bytes


def check_peak_saved(fn: Callable[..., int]) -> None:
    """`fn(layers, n, d, f, policy)` -> the peak bytes of saved activations (float32, weights excluded) over one
    forward and backward of `layers` MLP blocks x -> gelu(x w1^T) w2^T, with `policy` "none" (plain autograd),
    "selective" (x and x w1^T kept per block, exercises 1 and 2) or "full" (each block checkpointed, its input kept);
    predicted, then counted by autograd's saved-tensor hooks."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (peak_saved)")
    rnd = random.Random(draw_seed())  # shapes drawn afresh every grade run
    shapes = [(3, 4, 2, 8), (1, 5, 3, 3)]
    for _ in range(2):
        shapes.append((rnd.randint(2, 6), rnd.randint(2, 9), rnd.randint(2, 8), rnd.randint(2, 16)))
    cases = 0
    for layers, n, d, f in shapes:
        for policy in ("none", "selective", "full"):
            call = f"peak_saved(layers={layers}, n={n}, d={d}, f={f}, policy={policy!r})"
            measured = _measured_mlp_bytes(layers, n, d, f, policy)
            try:
                said = fn(layers, n, d, f, policy)
            except NotImplementedError:
                raise
            except Exception as e:
                raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
            assert said == measured, (
                f"{call}: you predict {said!r} bytes at the peak, autograd held {measured}"
            )
            cases += 1
    passed("check_peak_saved", f"{cases} peaks predicted exactly, three policies")
