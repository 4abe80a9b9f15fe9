"""Checks for lesson 15's exercises: one magnitude threshold over several tensors, and the gradient of the
distillation loss worked out by hand.

`global_magnitude_masks(weights, sparsity)` (a dict of tensors of different shapes and scales) must prune the
round(sparsity · total) weights of smallest |w| over the union of all tensors, one threshold for all: the
masks are compared, tensor by tensor, with this module's own ranking. Every run draws the shapes, the values
(continuous, so no two |w| are equal) and one tensor 10 to 100 times smaller in scale than another; fixed
cases add sparsity 0 and 1, a whole tensor pruned, a 0-d and a 1-element tensor.

`distillation_grad(student_logits, teacher_logits, targets, temperature, alpha)` must return the gradient of
the lesson's loss (alpha · T² · KL of the softened distributions + (1 - alpha) · cross-entropy, both averaged
over the rows) with respect to the student's logits, without autograd: it is compared in float64, to 1e-10,
with what autograd gives for this module's own loss, on rows, classes, T (0.5 to 8) and alpha drawn every run.
While it runs, torch's ways to differentiate are switched off and `_Watch` refuses graphs, complex numbers,
backward kernels and the work of a numerical derivative (see GRAD_FORBIDDEN).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.grading.checks import (
    WriteItYourself,
    call_learner,
    differentiation_off,
    differentiation_refused,
    draw_seed,
    family,
    guarded,
    passed,
    require_callable,
    stay_in_torch,
    threads_off,
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
_ONE_THREAD = "run your tensor operations on the thread that calls your function: the check watches that one"
_IN_TORCH = "keep the computation in tensor operations: the check counts them"
#: every way to let torch differentiate: reverse mode (the engine's Python entry points), torch.func's
#: transforms, torch.autograd.functional, forward mode; and the lab's distillation. `_Watch` below sees every
#: aten op on the thread that calls the learner's function and refuses there: any op given a tensor that
#: requires grad (so no graph is recorded, whatever then runs it: `Variable._execution_engine.run_backward`,
#: which cannot be patched, a node called by hand, under the learner's own saved-tensor hooks), complex numbers
#: (the complex-step derivative), torch's backward kernels (aten's *_backward ops, autograd's own formulas),
#: and more work than a gradient by hand needs (a finite difference evaluates the loss at least twice per
#: logit). Starting a thread and moving the logits to numpy or Python lists are switched off, so the watch sees
#: the computation. Not caught: a thread started before the check, another process handed the logits (a file,
#: a pipe), the logits read through torch's C methods (`torch._C.TensorBase.numpy`) or their storage's bytes,
#: and the watch itself popped with torch's private dispatch calls; the check is no sandbox.
GRAD_FORBIDDEN = {
    **family("parallel_lab.compression.distillation", instead=_BY_HAND),
    **differentiation_off(_BY_HAND),
    **threads_off(_ONE_THREAD),
    **stay_in_torch(_IN_TORCH),
}

__all__ = ["check_distillation_grad", "check_global_magnitude_masks"]


# ----------------------------------------------------------------------------- exercise 1: one threshold
def _reference_masks(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    names = list(weights)
    flat = torch.cat([weights[n].detach().abs().reshape(-1).double() for n in names])
    k = round(sparsity * flat.numel())
    keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
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
        specs, scales = [], [rnd.uniform(0.5, 2.0) for _ in range(rnd.randint(3, 4))]
        small, other = rnd.sample(range(len(scales)), 2)
        scales[small] = scales[other] / rnd.uniform(
            10, 100
        )  # one tensor 10 to 100 times smaller than another
        for j, scale in enumerate(scales):
            shape = tuple(rnd.randint(1, 9) for _ in range(rnd.choice((1, 2, 2, 3))))
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


#: a gradient by hand reads and writes the (N, V) logits a few dozen times at most (the reference: about 12);
#: a central difference evaluates the loss twice per logit, at least 5 passes over a row each time
_PASSES, _SCALARS = 48, 16


class _Watch(TorchDispatchMode):
    """Sees every aten op the learner's function runs on the calling thread and refuses those a gradient by hand
    never needs; counts the elements each op touches, and the tensors read into Python numbers one at a time."""

    def __init__(self, exercise: str, rows: int, classes: int):
        super().__init__()
        self.exercise, self.rows, self.classes = exercise, rows, classes
        self.work = self.scalars = 0

    def refuse(self, what: str):
        raise WriteItYourself(f"{self.exercise} asks for the gradient by hand, so {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        why = differentiation_refused(func, ins)
        if why:
            self.refuse(f"{why}; {_BY_HAND}")
        out = func(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(a.is_complex() for a in ins + outs):
            self.refuse(f"complex numbers are refused while the check runs (aten.{name}); {_BY_HAND}")
        # a view (a row of the logits) touches its own elements, not its base's
        self.work += max((a.numel() for a in (outs if func.is_view else ins + outs)), default=0)
        self.scalars += name == "_local_scalar_dense"
        if self.work > _PASSES * self.rows * self.classes + 64 * self.classes:
            self.refuse(
                f"your function did more work than {_PASSES} passes over the ({self.rows}, {self.classes}) "
                "logits, which a gradient by hand does not need: a numerical derivative is refused (a finite "
                "difference evaluates the loss at least twice per logit); check your answer with one in a cell "
                f"of your own, and {_BY_HAND}"
            )
        if self.scalars > 2 * self.rows + _SCALARS:
            self.refuse(
                f"reading tensors into Python numbers one at a time is refused past {2 * self.rows + _SCALARS} "
                f"of them; {_BY_HAND}"
            )
        return out


def _mistake(got: torch.Tensor, want: torch.Tensor, s, t, y, T: float, alpha: float) -> str:
    """Which known slip `got` is, if any; a slip whose value equals the right one in this case (one row, T = 1,
    alpha = 0 or 1) is not named."""
    n = s.shape[0]
    ps, pt, p1 = (s / T).softmax(-1), (t / T).softmax(-1), s.softmax(-1)
    hot = torch.nn.functional.one_hot(y, s.shape[1]).double()
    hard = (1 - alpha) * (p1 - hot) / n
    soft = alpha * T * (ps - pt) / n
    slips = {
        "the soft term is off by a factor of T (too large)": soft * T + hard,
        "the soft term is off by a factor of T² (too small)": soft / T / T + hard,
        "the gradient is off by a factor of N, the number of rows (too large)": (soft + hard) * n,
        "the soft term has the wrong sign: descending the KL divergence pulls the student's probabilities "
        "towards the teacher's": -soft + hard,
        "the hard term differs: it looks computed from the softened probabilities": soft
        + (1 - alpha) * (ps - hot) / n,
    }
    for name, value in slips.items():
        close = torch.allclose(value, want, rtol=1e-8, atol=1e-12)
        if not close and torch.allclose(got, value, rtol=1e-8, atol=1e-12):
            return f" ({name})"
    return ""


def check_distillation_grad(distillation_grad: Callable) -> None:
    """`distillation_grad(student_logits, teacher_logits, targets, temperature, alpha)` -> d loss / d student_logits."""
    require_callable(distillation_grad, "distillation_grad")
    exercise = "this exercise (distillation_grad)"
    guard = guarded(distillation_grad, GRAD_FORBIDDEN, exercise)

    def fn(*args):
        with _Watch(exercise, *args[0].shape):
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
                + _mistake(got, want, s, t, y, T, alpha)
            )
    passed("check_distillation_grad", f"{len(cases)} cases, within 1e-10")
