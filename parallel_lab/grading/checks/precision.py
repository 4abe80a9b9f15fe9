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
    # FSDP's scaler repeats the rule in Python for CPU scales
    **{
        f"torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler.{m}": ""
        for m in ("update", "_amp_update_scale_cpu_", "unscale_", "_unscale_grads_")
    },
    "torch._amp_foreach_non_finite_check_and_unscale_": "",
}

__all__ = ["check_master_weight_step", "check_skipped_steps", "check_smallest_update"]

FP16_MAX = 65504.0


def _measured_skips(steps: int, grad_max: float, init_scale: float, growth_interval: int) -> int:
    """Steps torch.amp.GradScaler skips when every step's largest unscaled gradient in fp16 is `grad_max`.

    The model is one fp32 parameter computed with in fp16, as under autocast: the gradient reaching the
    fp16 tensor is S * grad_max, converted to fp16 on its way, where it overflows or not."""
    w = torch.zeros(4, requires_grad=True)  # the fp32 (master) parameter
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)  # fmt: skip
    skipped = 0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = w.half().float().sum() * grad_max  # d loss / d (the fp16 tensor) = grad_max
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before  # a skipped step backs the scale off
    return skipped


def check_skipped_steps(fn: Callable[..., int]) -> None:
    """`fn(steps, grad_max, init_scale, growth_interval)` -> how many of `steps` steps GradScaler (growth 2,
    backoff 0.5) skips when every step's largest gradient is `grad_max` in fp16; predicted, then measured
    on real fp16 backward passes under torch.amp.GradScaler("cpu")."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (skipped_steps)")
    rnd = random.Random(draw_seed())  # gradients, scales, intervals and lengths drawn afresh every grade run
    top = 2.0**15  # the scale at which the fixed edge cases sit at fp16's top
    cases = [
        (40, 1.0, 2.0**24, 5),  # the lesson's start at 2^24, halving down to what fits
        (31, 65510.0 / top, top, 4),  # 65,510 is not an fp16 number, and yet no overflow
        (31, 65520.0 / top, top, 4),  # halfway from 65,504 to 2^16: ties to even, 2^16, inf
        (25, 0.0, 2.0**16, 1),  # nothing to overflow: the scale only grows
        (60, 3.0, 1.0, 1),  # growth interval 1: the scale bounces off the ceiling
    ]
    for _ in range(5):
        cases.append((rnd.randint(20, 300), round(10 ** rnd.uniform(-3, 3), 6), 2.0 ** rnd.randint(0, 24),
                      rnd.randint(1, 40)))  # fmt: skip
    for steps, grad_max, init_scale, interval in cases:
        want = _measured_skips(steps, grad_max, init_scale, interval)
        call = (f"skipped_steps(steps={steps}, grad_max={grad_max!r}, init_scale={init_scale:g}, "
                f"growth_interval={interval})")  # fmt: skip
        try:
            got = fn(steps, grad_max, init_scale, interval)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
        assert isinstance(got, int) and not isinstance(got, bool), f"{call}: return an int, got {got!r}"
        assert got == want, f"{call}: you predict {got} skipped steps, GradScaler skipped {want}"
    passed("check_skipped_steps", f"{len(cases)} runs of GradScaler predicted, step counts exact")


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
_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
_LIMIT = {"fp16": 30000.0, "bf16": 1e30, "e4m3": 200.0, "e5m2": 20000.0}  # weights kept off each format's top


def _stored(x: float, dtype: torch.dtype) -> float:
    return torch.tensor(x, dtype=torch.float64).to(dtype).double().item()


def _smallest_surviving(weight: float, dtype: torch.dtype) -> float:
    """Bisection on the update u: the smallest u > 0 for which the exact sum weight + u, rounded to
    `dtype`, is not the weight any more."""

    def survives(u: float) -> bool:
        return _stored(weight + u, dtype) != weight

    lo, hi = 1e-45, abs(weight) if weight else 1.0
    assert survives(hi) and not survives(lo)
    for _ in range(200):
        mid = (lo * hi) ** 0.5 if hi / lo > 4 else (lo + hi) / 2
        lo, hi = (lo, mid) if survives(mid) else (mid, hi)
    return hi


def _drawn_weight(rnd: random.Random, name: str) -> float:
    """A number of the format: either sign, anywhere from its subnormals to below its top."""
    info = torch.finfo(_DTYPES[name])
    low = math.log2(info.smallest_normal) - (10 if name in ("fp16", "bf16") else 2)  # into the subnormals
    x = rnd.choice((-1.0, 1.0)) * 2.0 ** rnd.uniform(low, math.log2(_LIMIT[name]))
    return _stored(x, _DTYPES[name]) or info.smallest_normal


def check_smallest_update(fn: Callable[[float, str], float]) -> None:
    """`fn(weight, dtype)` -> the smallest positive update u for which weight + u, computed exactly and
    rounded to `dtype` ("fp16", "bf16", "e4m3", "e5m2"), is no longer `weight`; `weight` is a number of that
    format (zero, negative and subnormal ones included). Predicted, then found by bisection (within 1%)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (smallest_update)")
    cases = [(1.0, "fp16"), (0.75, "bf16"), (-1.0, "fp16"), (-2.0, "e4m3"), (3.0, "e5m2"), (0.0, "e5m2"),
             (2.0**-20, "fp16"), (-(2.0**-8), "e4m3"), (60000.0, "fp16"), (-1000.0, "bf16")]  # fmt: skip
    rnd = random.Random(draw_seed())  # and one weight per format drawn afresh every grade run
    cases += [(_drawn_weight(rnd, name), name) for name in _DTYPES]
    for weight, name in cases:
        measured = _smallest_surviving(weight, _DTYPES[name])
        call = f"smallest_update({weight!r}, {name!r})"
        try:
            said = fn(weight, name)
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call}: your function raised {type(e).__name__}: {e}") from e
        assert isinstance(said, (int, float)) and not isinstance(said, bool) and said > 0, (
            f"{call} must return a positive number, got {said!r}"
        )
        assert abs(said - measured) <= 0.01 * measured, (
            f"{call}: you predict updates from {said:.6g} on change it; measured: {measured:.6g} "
            f"({said / measured:.3g}x)"
        )
    passed("check_smallest_update", f"{len(cases)} thresholds in four formats predicted within 1%")
