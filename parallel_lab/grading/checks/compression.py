"""Checks for lesson 15's exercises: one magnitude threshold over several tensors, and the gradient of the
distillation loss worked out by hand.

`global_magnitude_masks(weights, sparsity)` (a dict of tensors of different shapes and scales) must prune the
round(sparsity · total) weights of smallest |w| over the union of all tensors, one threshold for all: the
masks are compared, tensor by tensor, with this module's own ranking. Every run draws the shapes, the values
(continuous, so no two |w| are equal) and one layer 10 to 100 times smaller than another; fixed cases add
sparsity 0 and 1, a whole tensor pruned, a 0-d and a 1-element tensor.

`distillation_grad(student_logits, teacher_logits, targets, temperature, alpha)` must return the gradient of
the lesson's loss (alpha · T² · KL of the softened distributions + (1 - alpha) · cross-entropy, both averaged
over the rows) with respect to the student's logits, without autograd: it is compared in float64, to 1e-10,
with what autograd gives for this module's own loss, on rows, classes, T (0.5 to 8) and alpha drawn every run.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import (
    WriteItYourself,
    call_learner,
    draw_seed,
    family,
    guarded,
    passed,
    require_callable,
)

_PRUNE = "rank the magnitudes of all the tensors yourself"
#: the lab's pruning and torch's: `torch.nn.utils.prune` (l1_unstructured, global_unstructured, ...) and the
#: sparsifiers and pruners of `torch.ao.pruning` (WeightNormSparsifier ranks weights by norm)
PRUNE_FORBIDDEN = {
    **family("parallel_lab.compression.pruning", instead=_PRUNE),
    **family("torch.nn.utils.prune", instead=_PRUNE),
    **family(
        "torch.ao.pruning.sparsifier.base_sparsifier",
        "torch.ao.pruning.sparsifier.weight_norm_sparsifier",
        "torch.ao.pruning.sparsifier.nearly_diagonal_sparsifier",
        "torch.ao.pruning.sparsifier.utils",
        "torch.ao.pruning._experimental.pruner.base_structured_sparsifier",
        "torch.ao.pruning._experimental.pruner.saliency_pruner",
        "torch.ao.pruning._experimental.pruner.FPGM_pruner",
        "torch.ao.pruning._experimental.pruner.lstm_saliency_pruner",
        "torch.ao.pruning._experimental.pruner.prune_functions",
        "torch.ao.pruning._experimental.data_sparsifier.base_data_sparsifier",
        "torch.ao.pruning._experimental.data_sparsifier.data_norm_sparsifier",
        "torch.ao.pruning._experimental.activation_sparsifier.activation_sparsifier",
        instead=_PRUNE,
        missing_ok=True,
    ),
    "parallel_lab.grading.checks.compression._reference_masks": _PRUNE,  # and this check's own
}

_BY_HAND = "differentiate the loss on paper and compute the result with plain tensor operations"
#: every way to let torch differentiate: reverse mode (the engine's Python entry points), torch.func's
#: transforms, torch.autograd.functional, forward mode; and the lab's distillation. A graph built and run
#: through the C++ engine directly is caught by `_no_graph` below.
GRAD_FORBIDDEN = {
    **family("parallel_lab.compression.distillation", instead=_BY_HAND),
    "torch.autograd.grad": _BY_HAND,
    "torch.autograd.backward": _BY_HAND,
    "torch.Tensor.backward": _BY_HAND,
    "torch.autograd.graph._engine_run_backward": _BY_HAND,
    **family("torch.func", "torch.autograd.functional", "torch.autograd.forward_ad", instead=_BY_HAND),
    **family("torch._functorch.eager_transforms", "torch._functorch.apis", instead=_BY_HAND, missing_ok=True),
}

__all__ = ["check_distillation_grad", "check_global_magnitude_masks"]


# ----------------------------------------------------------------------------- exercise 1: one threshold
def _reference_masks(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    names = list(weights)
    flat = torch.cat([weights[n].detach().abs().reshape(-1).double() for n in names])
    k = round(sparsity * flat.numel())
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[flat.argsort()[:k]] = False
    out, at = {}, 0
    for n in names:
        size = weights[n].numel()
        out[n] = keep[at : at + size].view(weights[n].shape)
        at += size
    return out


def _distinct(g: torch.Generator, shape: tuple[int, ...], scale: float, taken: set) -> torch.Tensor:
    """Normal weights times `scale`, none of whose |w| equals another's (in this tensor or in `taken`)."""
    while True:
        w = torch.randn(shape, generator=g) * scale
        mags = w.abs().flatten().tolist()
        if len(set(mags)) == len(mags) and not taken & set(mags) and all(mags):
            taken |= set(mags)
            return w


def _layers(g: torch.Generator, specs) -> dict[str, torch.Tensor]:
    taken: set = set()
    return {name: _distinct(g, shape, scale, taken) for name, shape, scale in specs}


def _mask_cases(seed: int) -> list[tuple[str, dict[str, torch.Tensor], float]]:
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    fixed = [
        ("sparsity 0", _layers(g, [("fc", (4, 6), 1.0), ("proj", (6, 4), 0.1)]), 0.0),
        ("sparsity 1", _layers(g, [("fc", (4, 6), 1.0), ("proj", (6, 4), 0.1)]), 1.0),
        # 48 weights of scale 1e-3 and 16 of scale 1: pruning 50 leaves the small layer nothing
        ("a layer pruned whole", _layers(g, [("big", (4, 4), 1.0), ("tiny", (6, 8), 1e-3)]), 50 / 64),
        (
            "a 0-d and a 1-element tensor",
            _layers(g, [("scalar", (), 0.05), ("one", (1,), 3.0), ("w", (5, 3), 1.0)]),
            0.41,
        ),
        # 1.35 weights of each tensor, 5.4 of the union: a count rounded per tensor and summed prunes 4
        ("four tensors of three weights", _layers(g, [(f"l{i}", (3,), 10.0**-i) for i in range(4)]), 0.45),
    ]
    drawn = []
    for i in range(6):
        specs, small = [], rnd.randrange(3)
        for j in range(rnd.randint(3, 4)):
            shape = tuple(rnd.randint(1, 9) for _ in range(rnd.choice((1, 2, 2, 3))))
            scale = rnd.uniform(0.5, 2.0) / (rnd.uniform(10, 100) if j == small else 1.0)
            specs.append((rnd.choice("abcdefgh") + f"{j}.weight", shape, scale))
        layers = _layers(g, specs)
        total = sum(w.numel() for w in layers.values())
        # a sparsity whose count s · total has a fraction above one half, so rounding and cutting differ
        k = rnd.randint(1, total - 1)
        drawn.append((f"drawn case {i + 1}", layers, round((k + rnd.uniform(0.55, 0.95)) / total, 6)))
    return fixed + drawn


def _call(name: str, layers: dict[str, torch.Tensor], s: float) -> str:
    shapes = ", ".join(f"{n!r}: {tuple(w.shape)}" for n, w in layers.items())
    return f"{name}(weights={{{shapes}}}, sparsity={s})"


def check_global_magnitude_masks(global_magnitude_masks: Callable) -> None:
    """`global_magnitude_masks(weights, sparsity)` -> {name: bool mask, True = kept}, one threshold for all."""
    require_callable(global_magnitude_masks, "global_magnitude_masks")
    fn = guarded(global_magnitude_masks, PRUNE_FORBIDDEN, "this exercise (global_magnitude_masks)")
    cases = _mask_cases(draw_seed())  # shapes, scales and values drawn afresh every grade run
    for what, layers, s in cases:
        call = _call("global_magnitude_masks", layers, s) + f" [{what}]"
        given = {n: w.clone() for n, w in layers.items()}
        got = call_learner(fn, call, given, s)
        assert all(torch.equal(given[n], layers[n]) for n in layers), (
            f"{call}: the weights were changed; return masks only"
        )
        assert isinstance(got, dict) and set(got) == set(layers), (
            f"{call}: expected a dict with the keys {sorted(layers)}, got "
            + (f"the keys {sorted(got)}" if isinstance(got, dict) else type(got).__name__)
        )
        want = _reference_masks(layers, s)
        for n, w in layers.items():
            m = got[n]
            assert isinstance(m, torch.Tensor) and m.shape == w.shape and m.dtype == torch.bool, (
                f"{call}: the mask of {n!r} must be a bool tensor of shape {tuple(w.shape)}, got "
                + (
                    f"{m.dtype} of shape {tuple(m.shape)}"
                    if isinstance(m, torch.Tensor)
                    else type(m).__name__
                )
            )
        total = sum(w.numel() for w in layers.values())
        pruned = sum(int((~got[n]).sum()) for n in layers)
        k = sum(int((~want[n]).sum()) for n in layers)
        assert pruned == k, (
            f"{call}: {pruned} weights pruned in all, expected round({s} x {total}) = {k} over the union "
            "of the tensors"
        )
        if all(torch.equal(got[n], want[n]) for n in layers):
            continue
        share = {n: _reference_masks({n: w}, s)[n] for n, w in layers.items()}
        if all(torch.equal(got[n], share[n]) for n in layers):
            n = next(n for n in layers if not torch.equal(share[n], want[n]))
            raise AssertionError(
                f"{call}: {int((~got[n]).sum())} of the {layers[n].numel()} weights of {n!r} pruned, expected "
                f"{int((~want[n]).sum())}: one threshold on |w| for every tensor, not the same share of each"
            )
        gone = max((layers[n].abs()[~got[n]].max().item(), n) for n in layers if (~got[n]).any())
        kept = min((layers[n].abs()[got[n]].min().item(), n) for n in layers if got[n].any())
        raise AssertionError(
            f"{call}: a weight of |w| = {gone[0]:.3g} in {gone[1]!r} was pruned while one of |w| = {kept[0]:.3g} "
            f"in {kept[1]!r} was kept: prune the smallest magnitudes, whatever their sign and tensor"
        )
    passed("check_global_magnitude_masks", f"{len(cases)} sets of tensors, one threshold each")


# ----------------------------------------------------------------------------- exercise 2: the gradient
def _loss(s: torch.Tensor, t: torch.Tensor, y: torch.Tensor, T: float, alpha: float) -> torch.Tensor:
    log_ps, log_pt = (s / T).log_softmax(-1), (t / T).log_softmax(-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()
    ce = -s.log_softmax(-1).gather(1, y[:, None]).mean()
    return alpha * T * T * kl + (1 - alpha) * ce


def _grad_cases(seed: int) -> list[tuple[int, int, float, float]]:
    rnd = random.Random(seed)
    fixed = [(1, 5, 3.0, 0.5), (4, 7, 1.0, 0.3), (3, 6, 2.5, 0.0), (5, 4, 4.0, 1.0)]
    drawn = [(rnd.randint(2, 8), rnd.randint(2, 12), round(math.exp(rnd.uniform(math.log(0.5), math.log(8))), 4),
              round(rnd.uniform(0.05, 0.95), 4)) for _ in range(6)]  # fmt: skip
    return fixed + drawn


@contextlib.contextmanager
def _no_graph(exercise: str):
    """No autograd graph may be built while the learner's function runs: torch saves tensors for the backward
    pass of every differentiable op it records, and the hook below refuses each."""

    def pack(_):
        raise WriteItYourself(
            f"{exercise} asks for the gradient without autograd, which is switched off while the check runs: "
            f"an operation recorded an autograd graph (a tensor that requires grad was used); {_BY_HAND}"
        )

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield


def _mistake(got: torch.Tensor, s, t, y, T: float, alpha: float) -> str:
    """Which known slip `got` is, if any (each a different number whenever T is not 1 and 0 < alpha < 1)."""
    n = s.shape[0]
    ps, pt, p1 = (s / T).softmax(-1), (t / T).softmax(-1), s.softmax(-1)
    hot = torch.nn.functional.one_hot(y, s.shape[1]).double()
    hard = (1 - alpha) * (p1 - hot) / n
    soft = alpha * T * (ps - pt) / n
    slips = {
        "the soft term is T times too large: T² stays, but the chain rule through s / T divides by T": soft
        * T
        + hard,
        "the soft term is T² times too small: the loss multiplies it by T²": soft / T / T + hard,
        "the gradient is N times too large: the loss is a mean over the N rows": (soft + hard) * n,
        "the soft term has the wrong sign: the gradient of KL(teacher ‖ student) pushes the student's "
        "probabilities towards the teacher's": -soft + hard,
        "the hard term uses the softened probabilities: the cross-entropy is at temperature 1": soft
        + (1 - alpha) * (ps - hot) / n,
    }
    for name, value in slips.items():
        if torch.allclose(got, value, rtol=1e-8, atol=1e-12):
            return f" ({name})"
    return ""


def check_distillation_grad(distillation_grad: Callable) -> None:
    """`distillation_grad(student_logits, teacher_logits, targets, temperature, alpha)` -> d loss / d student_logits."""
    require_callable(distillation_grad, "distillation_grad")
    exercise = "this exercise (distillation_grad)"
    guard = guarded(distillation_grad, GRAD_FORBIDDEN, exercise)

    def fn(*args):
        with _no_graph(exercise):
            return guard(*args)

    seed = draw_seed()  # rows, classes, T, alpha and the logits drawn afresh every grade run
    g = torch.Generator().manual_seed(seed)
    cases = _grad_cases(seed)
    for n, v, T, alpha in cases:
        s = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
        t = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
        y = torch.randint(v, (n,), generator=g)
        call = (f"distillation_grad(student_logits=<{n}x{v} float64>, teacher_logits=<{n}x{v} float64>, "
                f"targets=<{n} labels>, temperature={T}, alpha={alpha})")  # fmt: skip
        args = (s.clone(), t.clone(), y.clone(), T, alpha)
        got = call_learner(fn, call, *args)
        assert isinstance(got, torch.Tensor) and got.shape == s.shape, (
            f"{call}: expected a tensor of shape {tuple(s.shape)}, got "
            + (f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__)
        )
        assert got.grad_fn is None and not got.requires_grad, (
            f"{call}: the result carries an autograd graph; compute it with plain tensor operations"
        )
        assert got.dtype == torch.float64, f"{call}: expected float64 (the logits' dtype), got {got.dtype}"
        leaf = s.clone().requires_grad_()
        (want,) = torch.autograd.grad(_loss(leaf, t, y, T, alpha), leaf)
        err = (got - want).abs().max().item()
        if not err <= 1e-10 * max(1.0, want.abs().max().item()):
            raise AssertionError(
                f"{call}: the gradient differs from the loss's by up to {err:.3g}"
                + _mistake(got, s, t, y, T, alpha)
            )
    passed("check_distillation_grad", f"{len(cases)} cases, within 1e-10")
