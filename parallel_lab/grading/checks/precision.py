"""Checks for lesson 06 (mixed precision): the dynamic loss-scale rule and the master-weight step."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

_LOW = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


class _NoLowPrecision(TorchDispatchMode):
    """Refuses every op that makes a 16- or 8-bit float tensor: the exercise asks for reasoning about the
    format, not for a search with torch's own rounding."""

    def __init__(self, exercise: str) -> None:
        super().__init__()
        self.exercise = exercise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in _LOW:
                raise AssertionError(
                    f"{self.exercise}: your code made a {str(t.dtype).replace('torch.', '')} tensor ({func}); this "
                    "exercise asks you to work it out from the format, without low-precision arithmetic"
                )
        return out


def _reasoned(fn: Callable, exercise: str) -> Callable:
    def call(*args, **kwargs):
        with _NoLowPrecision(exercise):
            return fn(*args, **kwargs)

    return call


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

__all__ = ["check_compensated_step", "check_skipped_steps", "check_smallest_update"]

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
    fn = _reasoned(guarded(fn, FORBIDDEN, "this exercise (skipped_steps)"), "skipped_steps")
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


BF16_EPS = 2.0**-7  # bf16's gap at 1.0: 7 stored mantissa bits


def _compensated_case(rnd: random.Random, spread: bool, shapes: list | None = None):
    """bf16 weights near 1 (or spread over four decades), and 300 updates each far below half a gap."""
    shapes = shapes or [(rnd.randint(3, 9), rnd.randint(2, 6)) for _ in range(2)] + [(rnd.randint(5, 40),)]
    g = torch.Generator().manual_seed(rnd.getrandbits(62))
    weights, updates = [], []
    for s in shapes:
        size = 10 ** (4 * torch.rand(s, generator=g) - 2) if spread else torch.ones(s)
        weights.append((size * (1 + 0.1 * torch.randn(s, generator=g))).to(torch.bfloat16))
        # each step moves a weight by 1e-4 to 1.5e-3 of itself, always the same way: steps of 1/80 to
        # under 2/5 of a bf16 gap (lost one by one if simply added), a drift of several gaps in 300 steps
        rate = -(10 ** (-4 + torch.rand(s, generator=g))) * weights[-1].float()
        updates.append([rate * (1 + 0.5 * torch.rand(s, generator=g)) for _ in range(300)])
    return weights, [list(u) for u in zip(*updates)]  # updates[step][tensor]


def _ulps(w: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest distance from the reference, in bf16 gaps at the reference's size (2^(floor(log2|ref|) - 7))."""
    gap = torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)
    return ((w.float() - ref).abs() / gap).max().item()


def check_compensated_step(fn: Callable[..., None]) -> None:
    """`fn(params, comps, updates)`: add fp32 `updates` to bf16 `params` in place, keeping only the bf16
    `comps` between steps; after 300 steps of updates far below half a bf16 gap the weights must be within
    one bf16 gap of an fp32 run of the same updates (plain bf16 addition stays where it started). Two runs of
    the same shapes are called in turn, with new tensor objects every call, and each is reloaded once:
    state kept anywhere but in params and comps goes to the wrong run or goes stale."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (compensated_step)")
    rnd = random.Random(
        draw_seed()
    )  # sizes, weights, updates and the reload steps drawn afresh every grade run
    for spread in (False, True):
        shapes = [(rnd.randint(3, 9), rnd.randint(2, 6)) for _ in range(2)] + [(rnd.randint(5, 40),)]
        runs = []
        for _ in range(2):
            weights, updates = _compensated_case(rnd, spread, shapes)
            runs.append({"weights": weights, "updates": updates, "params": [w.clone() for w in weights],
                         "comps": [torch.zeros_like(w) for w in weights], "ref": [w.float() for w in weights],
                         "reload": rnd.randint(100, 200)})  # fmt: skip
        what = "one run spread from 0.01 to 100" if spread else "one run near 1.0"
        for step in range(300):
            for which, r in enumerate(runs):
                where = f"{what} (two runs called in turn: run {'AB'[which]}), step {step}"
                if step == r["reload"]:
                    for k, (p, c) in enumerate(zip(r["params"], r["comps"])):
                        p.copy_(r["weights"][k] * 1.5)  # a checkpoint written elsewhere: the weights change
                        c.zero_()
                        r["ref"][k] = p.float()
                params = [p.clone() for p in r["params"]]  # new tensor objects every call
                comps = [c.clone() for c in r["comps"]]
                try:
                    fn(params, comps, [u.clone() for u in r["updates"][step]])
                except NotImplementedError:
                    raise
                except Exception as e:
                    raise AssertionError(f"{where}: your function raised {type(e).__name__}: {e}") from e
                for p, c in zip(params, comps):
                    assert p.dtype == torch.bfloat16 and c.dtype == torch.bfloat16, (
                        f"{where}: params and comps must stay bf16 tensors (2 bytes each), got {p.dtype} "
                        f"and {c.dtype}"
                    )
                r["params"], r["comps"] = params, comps
                for k, u in enumerate(r["updates"][step]):
                    r["ref"][k] += u
                if step == r["reload"]:
                    far = max(_ulps(p, ref) for p, ref in zip(params, r["ref"]))
                    assert far <= 1.0, (
                        f"{where}: the weights were reloaded (changed, compensations zeroed) just before this call, "
                        f"and your weights are {far:.1f} bf16 gaps from them plus this step's update: state kept "
                        "anywhere but in params and comps goes stale"
                    )
        for which, r in enumerate(runs):
            far = max(_ulps(p, ref) for p, ref in zip(r["params"], r["ref"]))
            assert far <= 1.0, (
                f"{what} (run {'AB'[which]}), after 300 steps of updates each well below half a bf16 gap: your "
                f"weights are {far:.1f} bf16 gaps from an fp32 run of the same updates (within 1 expected); "
                "with two runs called in turn, keep what a run carries in its own comps"
            )
    passed(
        "check_compensated_step",
        "4 runs of 300 steps, called in pairs, follow the fp32 run within one bf16 gap",
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
    fn = _reasoned(guarded(fn, FORBIDDEN, "this exercise (smallest_update)"), "smallest_update")
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
