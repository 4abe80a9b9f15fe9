"""Checks for lesson 06 (mixed precision): the dynamic loss-scale rule and the master-weight step."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

# The lab's loss scaler and mixed-precision optimizer, and torch's GradScaler, switched off
# while the learner's function runs.
FORBIDDEN = {
    **family("parallel_lab.precision.mixed"),
    **{
        f"torch.amp.grad_scaler.GradScaler.{m}": "" for m in ("update", "step", "unscale_", "_unscale_grads_")
    },
    "torch._amp_update_scale_": "",
    "torch._amp_foreach_non_finite_check_and_unscale_": "",
}

__all__ = ["check_master_weight_step", "check_update_scale", "check_smallest_update"]

#: (init scale, growth factor, backoff factor, growth interval)
_SETTINGS = ((2.0**16, 2.0, 0.5, 3), (1.0, 2.0, 0.5, 1), (1024.0, 4.0, 0.25, 2), (7.0, 1.5, 0.3, 5))


def check_update_scale(fn: Callable[..., tuple[float, int]]) -> None:
    """`fn(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)` -> (scale, tracker),
    compared step by step with `torch._amp_update_scale_`, the kernel `torch.amp.GradScaler.update` runs."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (update_scale)")
    rng = random.Random(draw_seed())  # overflow patterns drawn afresh every grade run
    steps = 0
    for init, growth, backoff, interval in _SETTINGS:
        scale_t = torch.full((), init, dtype=torch.float32)
        tracker_t = torch.zeros((), dtype=torch.int32)
        ours = (init, 0)
        pattern = [rng.random() < 0.25 for _ in range(60)]
        for i, found in enumerate(pattern):
            before = ours
            torch._amp_update_scale_(
                scale_t, tracker_t, torch.full((), float(found)), growth, backoff, interval
            )
            want = (scale_t.item(), int(tracker_t.item()))
            got = fn(before[0], before[1], found, growth, backoff, interval)
            where = (f"growth_factor={growth}, backoff_factor={backoff}, growth_interval={interval}, step {i}: "
                     f"scale={before[0]:g}, growth_tracker={before[1]}, found_inf={found}")  # fmt: skip
            assert isinstance(got, tuple) and len(got) == 2, (
                f"{where}: return (scale, growth_tracker), got {got!r}"
            )
            assert math.isclose(float(got[0]), want[0], rel_tol=1e-6) and int(got[1]) == want[1], (
                f"{where}: expected (scale, growth_tracker) = ({want[0]:g}, {want[1]}), got ({got[0]:g}, {got[1]})"
                + (" (on an overflow: scale * backoff_factor, and the count restarts at 0)" if found else "")
            )
            ours = want
            steps += 1
    # Growing past fp32's largest number would make the scale inf: GradScaler keeps the old scale.
    big = 2.0**127
    got = fn(big, 1, False, 2.0, 0.5, 2)
    assert isinstance(got, tuple) and got[0] == big and got[1] == 0, (
        f"scale={big:g} (2^127), growth_tracker=1, growth_interval=2, a clean step: growing would give 2^128, "
        f"beyond fp32's max {torch.finfo(torch.float32).max:.4g} where the scale lives; expected ({big:g}, 0) "
        f"(keep the scale, restart the count), got {got!r}"
    )
    passed("check_update_scale", f"{steps + 1} steps match torch.amp.GradScaler's rule")


def _reference(params, masters, optimizer, scale) -> bool:
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / scale
    if not all(torch.isfinite(m.grad).all() for m in masters):
        for m in masters:
            m.grad = None
        return False
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
    return True


def _setup(dtype, opt_name: str, lr: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (5,)]
    fp32 = [torch.ones(s) + 0.01 * torch.randn(s, generator=g) for s in shapes]
    params = [torch.nn.Parameter(t.to(dtype)) for t in fp32]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = (torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam)(masters, lr=lr)
    return params, masters, opt


def check_master_weight_step(fn: Callable[..., bool]) -> None:
    """`fn(params, masters, optimizer, scale)` -> True if it stepped, False if it skipped.

    `params`: 16-bit parameters whose `.grad` holds the *scaled* gradient; `masters`: their
    fp32 copies, which `optimizer` updates. Checked against the recipe on tiny updates that
    fp16 alone would lose (SGD: lr * grad = 1e-5, far below half of fp16's spacing near 1.0), on
    overflows that must be skipped, with SGD and Adam, fp16 and bf16.
    """
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (master_weight_step)")
    cases, rnd = 0, random.Random(draw_seed())  # weights and overflow steps drawn afresh every grade run
    for dtype, opt_name, lr in (
        (torch.float16, "sgd", 1e-3),
        (torch.float16, "adam", 1e-4),
        (torch.bfloat16, "sgd", 1e-3),
    ):
        name = str(dtype).replace("torch.", "")
        seed = rnd.getrandbits(62)
        mine, ref = _setup(dtype, opt_name, lr, seed), _setup(dtype, opt_name, lr, seed)
        scale = 1024.0
        skipped = set(rnd.sample(range(1, 59), 2))
        for step in range(60):
            overflow = step in skipped
            grads = [torch.full_like(p, 0.01, dtype=torch.float32) * (1 + k) for k, p in enumerate(mine[0])]
            for params, _, _ in (mine, ref):
                for p, gr in zip(params, grads):
                    p.grad = (gr * scale).to(dtype)  # scaled gradient, 16-bit
                if overflow:
                    params[1].grad[0] = float("inf")
            want = _reference(*ref, scale)
            got = fn(*mine, scale)
            where = f"{name} weights, {opt_name}, lr={lr}, step {step}"
            assert got is want, (
                f"{where}: {'a gradient holds inf, so the step must be skipped (return False)' if overflow else 'all gradients are finite, so the step must run (return True)'}; got {got!r}"
            )
            for k, (p, m, mr) in enumerate(zip(mine[0], mine[1], ref[1])):
                d = (m.detach() - mr.detach()).abs().max().item()
                assert torch.allclose(m.detach(), mr.detach(), rtol=1e-6, atol=1e-9), (
                    f"{where}: fp32 master {k} differs from the recipe by {d:.3g}. Did you divide the gradient "
                    "by the loss scale in fp32 before the optimizer step"
                    + (", and skip the step on an overflow?" if overflow else "?")
                )
                assert p.dtype == dtype and torch.equal(p.detach(), mr.detach().to(dtype)), (
                    f"{where}: the {name} weight {k} must be the fp32 master rounded to {name} after the step "
                    f"(copy the master into it); max difference {(p.detach().float() - mr.detach()).abs().max():.3g}"
                )
            cases += 1
    passed(
        "check_master_weight_step",
        f"{cases} steps (fp16/bf16, SGD/Adam, 2 overflows skipped) match the recipe",
    )


# ----------------------------------------------------------------------------- predict, then measure
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _smallest_surviving(weight: float, dtype: torch.dtype) -> float:
    """Bisection on the update u: the smallest u > 0 for which weight + u != weight, both in `dtype`."""
    w = torch.tensor(weight, dtype=dtype)

    def survives(u: float) -> bool:
        return bool((w + torch.tensor(u, dtype=dtype)) != w)

    lo, hi = 1e-30, abs(weight)
    assert survives(hi) and not survives(lo)
    for _ in range(200):
        mid = (lo * hi) ** 0.5 if hi / lo > 4 else (lo + hi) / 2
        lo, hi = (lo, mid) if survives(mid) else (mid, hi)
    return hi


def check_smallest_update(fn: Callable[[float, str], float]) -> None:
    """`fn(weight, dtype)` -> the smallest positive update that still changes `weight` when both are
    in `dtype` ("fp16" or "bf16") and added there; predicted, then found by bisection on real 16-bit
    additions (within 1%)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (smallest_update)")
    cases = [(1.0, "fp16"), (1.0, "bf16"), (3.0, "fp16"), (0.1, "fp16"), (2.0, "fp16"), (1000.0, "bf16"),
             (0.75, "bf16"), (60000.0, "fp16")]  # fmt: skip
    rnd = random.Random(draw_seed())  # and two weights drawn afresh every grade run
    cases += [(round(rnd.uniform(0.01, 50000.0), 4), "fp16"), (round(10 ** rnd.uniform(-3, 6), 4), "bf16")]
    for weight, name in cases:
        measured = _smallest_surviving(weight, _DTYPES[name])
        said = fn(weight, name)
        assert isinstance(said, (int, float)) and not isinstance(said, bool) and said > 0, (
            f"smallest_update({weight}, {name!r}) must return a positive number, got {said!r}"
        )
        assert abs(said - measured) <= 0.01 * measured, (
            f"weight {weight} in {name}: you predict updates from {said:.6g} on change it; measured: {measured:.6g} "
            f"({said / measured:.3g}x). The spacing of {name} numbers next to the weight decides it"
        )
    passed("check_smallest_update", f"{len(cases)} thresholds predicted within 1%")
