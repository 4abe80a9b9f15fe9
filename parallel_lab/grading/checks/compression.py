"""Checks for lesson 15's exercises: a magnitude-pruning mask and the distillation loss.

`magnitude_mask(weight, sparsity)` must give the mask `torch.nn.utils.prune.l1_unstructured` gives
for the same amount (computed here, with torch's pruning switched off while the learner's function
runs): round(sparsity · n) weights of smallest |w| removed, on weights of both signs and amounts
whose count needs rounding. `distillation_loss(student_logits, teacher_logits, targets, temperature,
alpha)` is compared, value and gradient, with Hinton et al.'s formula computed here in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.utils.prune as torch_prune

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

_PRUNE = "rank the weights by magnitude yourself"
FORBIDDEN = {
    **family("parallel_lab.compression.pruning", "parallel_lab.compression.distillation"),
    "torch.nn.utils.prune.l1_unstructured": _PRUNE,
    "torch.nn.utils.prune.L1Unstructured.compute_mask": _PRUNE,
    "torch.nn.utils.prune.global_unstructured": _PRUNE,
}

__all__ = ["check_distillation_loss", "check_magnitude_mask"]


def _torch_mask(w: torch.Tensor, amount: float) -> torch.Tensor:
    holder = nn.Module()
    holder.weight = nn.Parameter(w.clone())
    torch_prune.l1_unstructured(holder, "weight", amount=amount)
    return holder.weight_mask.bool()


def check_magnitude_mask(magnitude_mask: Callable) -> None:
    """`magnitude_mask(weight, sparsity)` -> bool mask, False for the round(sparsity · n) smallest |w|."""
    require_callable(magnitude_mask, "magnitude_mask")
    fn = guarded(magnitude_mask, FORBIDDEN, "this exercise (magnitude_mask)")
    g = torch.Generator().manual_seed(draw_seed())  # the random weights are drawn afresh every grade run
    cases = [
        ("a 6x8 weight, sparsity 0.5", torch.randn(6, 8, generator=g), 0.5),
        ("10 weights, sparsity 0.37 (3.7 weights: round it)", torch.randn(10, generator=g), 0.37),
        (
            "negative weights of large magnitude",
            torch.tensor([-5.0, 0.1, -0.2, 3.0, -0.05, 0.3, -4.0, 0.01]),
            0.5,
        ),
        ("a 16x32 weight, sparsity 0.9", torch.randn(16, 32, generator=g), 0.9),
        ("sparsity 0 (keep all)", torch.randn(3, 4, generator=g), 0.0),
        ("sparsity 1 (prune all)", torch.randn(3, 4, generator=g), 1.0),
    ]
    for what, w, s in cases:
        before = w.clone()
        got = fn(w, s)
        want = _torch_mask(w, s)
        assert torch.equal(w, before), (
            f"{what}: magnitude_mask changed the weight it was given; return a mask only"
        )
        assert isinstance(got, torch.Tensor) and got.shape == w.shape, (
            f"{what}: expected a mask of shape {tuple(w.shape)}, got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
        )
        got = got.bool()
        removed, expected = int((~got).sum()), int((~want).sum())
        assert removed == expected, (
            f"{what}: {removed} weights pruned, expected round({s} x {w.numel()}) = {expected}"
        )
        if not torch.equal(got, want):
            kept_small = w.abs()[got].min().item() if got.any() else float("nan")
            pruned_big = w.abs()[~got].max().item()
            raise AssertionError(
                f"{what}: a weight of |w| = {pruned_big:.3g} was pruned while one of |w| = {kept_small:.3g} was kept: "
                "prune the smallest magnitudes"
            )
    passed("check_magnitude_mask", f"{len(cases)} weights, the masks of torch.nn.utils.prune.l1_unstructured")


def _reference(s: torch.Tensor, t: torch.Tensor, y: torch.Tensor, T: float, alpha: float) -> torch.Tensor:
    log_ps, log_pt = (s / T).log_softmax(-1), (t / T).log_softmax(-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    ce = -s.log_softmax(-1).gather(1, y[:, None]).mean()
    return alpha * T * T * kl + (1 - alpha) * ce


def check_distillation_loss(distillation_loss: Callable) -> None:
    """`distillation_loss(student_logits, teacher_logits, targets, temperature, alpha)` -> scalar tensor."""
    require_callable(distillation_loss, "distillation_loss")
    fn = guarded(distillation_loss, FORBIDDEN, "this exercise (distillation_loss)")
    g = torch.Generator().manual_seed(
        draw_seed()
    )  # logits, labels and one setting drawn afresh every grade run
    drawn = (int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g)),
             round(0.5 + 4.5 * float(torch.rand(1, generator=g)), 3), round(float(torch.rand(1, generator=g)), 3))  # fmt: skip
    cases = [(4, 5, 2.0, 0.5), (7, 10, 4.0, 0.9), (3, 6, 1.0, 0.3), (5, 8, 3.0, 1.0), (6, 4, 2.0, 0.0), drawn]
    for n, v, T, alpha in cases:
        what = f"{n} rows, {v} classes, T = {T:g}, alpha = {alpha:g}"
        s64 = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).requires_grad_()
        t64 = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
        y = torch.randint(v, (n,), generator=g)
        s = s64.detach().float().requires_grad_()
        got = fn(s, t64.float(), y, T, alpha)
        assert isinstance(got, torch.Tensor) and got.numel() == 1, (
            f"{what}: expected a scalar tensor, got {type(got).__name__}"
        )
        want = _reference(s64, t64, y, T, alpha)
        if not math.isclose(got.item(), want.item(), rel_tol=1e-4, abs_tol=1e-5):
            hints = []
            if alpha and math.isclose(
                got.item(),
                (want.item() - alpha * T * T * _kl(s64, t64, T)) + alpha * _kl(s64, t64, T),
                rel_tol=1e-4,
            ):
                hints.append("the soft term is missing its factor T²")
            raise AssertionError(
                f"{what}: loss {got.item():.6g}, expected {want.item():.6g}"
                + (f" ({'; '.join(hints)})" if hints else "")
                + ": alpha · T² · KL(teacher ‖ student), both softened by T and averaged over rows, plus "
                "(1 - alpha) · cross-entropy on the labels"
            )
        got.backward()
        want.backward()
        assert s.grad is not None, (
            f"{what}: no gradient reached the student's logits (was something detached?)"
        )
        err = (s.grad.double() - s64.grad).abs().max().item()
        assert err < 1e-4, f"{what}: the gradient with respect to the student's logits differs by {err:.3g}"
    passed("check_distillation_loss", f"{len(cases)} cases, value and gradient")


def _kl(s: torch.Tensor, t: torch.Tensor, T: float) -> float:
    log_ps, log_pt = (s.detach() / T).log_softmax(-1), (t / T).log_softmax(-1)
    return float((log_pt.exp() * (log_pt - log_ps)).sum(-1).mean())
