"""Checks for lesson 18's exercises: rounding to any small float format, error feedback for scaled-sign
compression, and the smallest margin that keeps delayed scaling from saturating.

`check_round_float(fn)`: `fn(x, exp_bits, man_bits, ieee)` is compared exactly (-0 and +0 count as one) with the
nearest value of the format (ties to the even code) on every value of it, the midpoints between neighbours, the
float32 values just beside them, subnormals and values beyond the largest (saturated without infinities, ``ieee=False`` as in the OCP MX
formats; ±inf from largest + half a step on, ``ieee=True``), for the MX formats FP4 E2M1, FP6 E3M2 and E2M3,
E5M2, and three formats drawn afresh every grade run. No float tensor narrower than 32 bits may be made while
it runs (torch's casts would do the rounding), and the lab's, torch's and torchao's rounding helpers are
switched off.

`check_ef_sign(fn)`: `fn(grad, residual, lr)` -> (delta, new_residual) against EF-SignSGD (Karimireddy et al.
2019): p = lr·g + e, delta = (‖p‖₁ / d)·sign(p), e' = p - delta, for 20 steps of gradients drawn afresh every
run, in float64; what was applied plus what is still held equals lr times every gradient.

`check_smallest_margin(fn)`: `fn(amaxes, largest, length)` -> the smallest integer margin with which the lab's
`DelayedScaling` (Transformer Engine's rule: the history's amax maps onto largest / 2^margin) never saturates
on the sequence; measured by running the recipe with that margin (nothing saturates) and one less (something
does), on amax sequences drawn afresh every run.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import math
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    guarded,
    passed,
    require_callable,
    threads_off,
)

FORBIDDEN = family("parallel_lab.precision.fp8", "parallel_lab.precision.fp8_linear")
#: torch's and torchao's own rounding to small formats (torchao is switched off only where it is loaded:
#: importing it prints log lines; an import of it inside the learner's function is refused instead)
TORCH_ROUNDING = ("torch._vendor.quack.mx_utils", "torch._vendor.quack.blockscaled_gemm_utils")
TORCHAO_ROUNDING = ("torchao.prototype.custom_fp_utils", "torchao.prototype.mx_formats.kernels",
                    "torchao.prototype.mx_formats.nvfp4_tensor", "torchao.float8.float8_utils")  # fmt: skip
EF_FORBIDDEN_MODULES = (
    "parallel_lab.data_parallel.compression",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms._comm_hooks.default_hooks",
)
MARGIN_FORBIDDEN = FORBIDDEN
#: narrow float dtypes: a cast to one of them is torch rounding for the learner
_NARROW = tuple(
    d for d in (getattr(torch, n, None) for n in (
        "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2")) if d is not None
)  # fmt: skip
#: (exp_bits, man_bits, ieee) of the named formats every run checks: OCP MX FP4 E2M1, FP6 E3M2 and E2M3, E5M2
NAMED = ((2, 1, False), (3, 2, False), (2, 3, False), (5, 2, True))

__all__ = ["check_ef_sign", "check_round_float", "check_smallest_margin"]


# ----------------------------------------------------------------------------- switching things off
class _NoNarrowFloats(TorchDispatchMode):
    """Fails the check when an op produces a float tensor narrower than 32 bits: the exercise is the rounding."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype in _NARROW for t in tree_leaves(out)):
            raise AssertionError(
                f"round_float made a {next(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor))} "
                f"tensor ({func}): torch's cast would round for you; compute the nearest value with float32 "
                "or float64 arithmetic"
            )
        return out


class _RefuseImports(importlib.abc.MetaPathFinder):
    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.prefixes:
            raise ImportError(f"{name} is switched off while this check runs: the exercise asks for your own")
        return None


@contextmanager
def _no_imports(*prefixes: str) -> Iterator[None]:
    finder = _RefuseImports(prefixes)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


_ONE_THREAD = "round on the thread that calls your function: the check watches that one"
#: a new thread would escape the dispatch mode (modes are per thread): switched off while round_float runs
THREADS_OFF = threads_off(_ONE_THREAD)


def _rounding_dirs() -> tuple[str, ...]:
    """Folders whose code rounds to small formats: torchao's and torch's vendored quack."""
    import importlib.util
    import os

    dirs = [os.path.join(os.path.dirname(torch.__file__), "_vendor", "quack")]
    spec = importlib.util.find_spec("torchao")
    if spec is not None and spec.submodule_search_locations:
        dirs += list(spec.submodule_search_locations)
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


@contextmanager
def _no_code_from(dirs: tuple[str, ...], what: str) -> Iterator[None]:
    """Refuses any call into code from `dirs` (however it was loaded: by import or by file path)."""
    import os

    def tracer(frame, event, arg):
        if event == "call" and os.path.realpath(frame.f_code.co_filename).startswith(dirs):
            raise AssertionError(f"{frame.f_code.co_filename} is switched off while this check runs: {what}")
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def _loaded(*modules: str) -> dict[str, str]:
    """`family` of the modules already imported (an import of one of the others is refused while checks run)."""
    return {k: v for m in modules if m in sys.modules for k, v in family(m).items()}


# ----------------------------------------------------------------------------- exercise 1: any format
def _values(e: int, m: int, ieee: bool) -> torch.Tensor:
    """Every non-negative finite value of the format, in code order (float64)."""
    bias = 2 ** (e - 1) - 1
    top = 2**e - 1 - int(ieee)  # the largest exponent code that holds finite numbers
    vals = [j * 2.0 ** (1 - bias - m) for j in range(2**m)]  # code 0: zero and the subnormals
    vals += [2.0 ** (c - bias) * (1 + j / 2**m) for c in range(1, top + 1) for j in range(2**m)]
    return torch.tensor(vals, dtype=torch.float64)


def _round_reference(x: torch.Tensor, e: int, m: int, ieee: bool) -> torch.Tensor:
    v = _values(e, m, ieee)
    a = x.double().abs()
    lo = (torch.searchsorted(v, a, right=True) - 1).clamp(0, len(v) - 1)
    hi = (lo + 1).clamp(max=len(v) - 1)
    d_lo, d_hi = a - v[lo], v[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # ties to the even code
    out = torch.where(up, v[hi], v[lo])
    top_step = v[-1] - v[-2]
    if ieee:  # round to nearest even past the top: from max + half a step on, the next "value" is inf
        out = torch.where(a >= v[-1] + top_step / 2, torch.tensor(math.inf, dtype=torch.float64), out)
    else:
        out = torch.where(a > v[-1], v[-1], out)
    return (out * torch.sign(x.double()).where(x != 0, torch.ones_like(a))).float()


def _probe_values(e: int, m: int, ieee: bool, g: torch.Generator) -> torch.Tensor:
    v = _values(e, m, ieee)
    mids = (v[1:] + v[:-1]) / 2
    step = v[-1] - v[-2]
    inf = torch.tensor(math.inf, dtype=torch.float64)
    edge = torch.tensor([v[-1] + step / 2, v[-1] + step / 4, v[-1] + step, 2 * v[-1], 1e30, v[1] / 2, v[1] / 4,
                         3 * v[1] / 4], dtype=torch.float64)  # fmt: skip
    drawn = torch.exp(
        torch.empty(512, dtype=torch.float64).uniform_(math.log(v[1] / 4), math.log(2 * v[-1]), generator=g)
    )
    m32 = mids.float()  # beside each tie by one float32 step: the inputs are float32
    inf32 = inf.float()
    pos = torch.cat(
        [v.float(), m32, m32.nextafter(inf32), m32.nextafter(-inf32), edge.float(), drawn.float()]
    )
    return torch.cat([pos, -pos])


def check_round_float(fn: Callable) -> None:
    """`fn(x, exp_bits, man_bits, ieee)` -> float32 tensor of the nearest value of each x in the format."""
    require_callable(fn, "round_float")
    targets = {
        **FORBIDDEN,
        **family(*TORCH_ROUNDING, missing_ok=True),
        **_loaded(*TORCHAO_ROUNDING),
        **THREADS_OFF,
    }
    fn = guarded(fn, targets, "this exercise (round_float)")
    rnd = random.Random(draw_seed())  # three formats and their probes drawn afresh every grade run
    g = torch.Generator().manual_seed(rnd.randrange(2**31))
    dirs = _rounding_dirs()
    formats = list(NAMED) + [(rnd.randint(2, 5), rnd.randint(1, 4), rnd.random() < 0.5) for _ in range(3)]
    for e, m, ieee in formats:
        x = _probe_values(e, m, ieee, g)
        want = _round_reference(x, e, m, ieee)
        where = f"round_float(x, exp_bits={e}, man_bits={m}, ieee={ieee})"
        with (
            _NoNarrowFloats(),
            _no_imports("torchao"),
            _no_code_from(dirs, "the exercise asks for your own rounding"),
        ):
            got = call_learner(fn, where, x.clone(), e, m, ieee)
        assert isinstance(got, torch.Tensor) and got.shape == x.shape, (
            f"{where}: return a tensor of the input's shape {tuple(x.shape)}; got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
        )
        got = got.float()
        bad = got != want
        if bad.any():
            i = int(bad.nonzero()[0])
            xv, gv, wv = float(x[i]), float(got[i]), float(want[i])
            v = _values(e, m, ieee)
            mids = (v[1:] + v[:-1]) / 2
            ieee_top = _round_reference(x, e, m, True)
            ieee_top = torch.where(
                ieee_top.isinf(), ieee_top.sign() * float(_values(e, m, True)[-1]), ieee_top
            )
            if not ieee and torch.equal(got, ieee_top):
                why = ("this format has no infinity: every exponent code, the top one included, holds numbers, so "
                       "its largest value is a binade higher than an IEEE-style format's")  # fmt: skip
            elif abs(xv) > float(v[-1]):
                why = ("past the largest value an IEEE-style format rounds to nearest as if the next exponent existed, "
                       "and that next value is infinity" if ieee else
                       "this format has no infinity: values past its largest saturate to it")  # fmt: skip
            elif (
                bool((mids == abs(xv)).any())
                and bool((v == abs(gv)).any())
                and abs(abs(gv) - abs(xv)) <= float((v[1:] - v[:-1]).max())
            ):
                why = "a value halfway between two neighbours goes to the one whose last mantissa bit is 0"
            elif abs(xv) < float(v[2**m]):
                why = "below the smallest normal number the values are subnormal: their spacing stays constant down to 0"
            else:
                why = f"with {m} mantissa bits there are {2**m} values per power of two"
            raise AssertionError(f"{where}: x = {xv!r} gave {gv!r}, expected {wv!r} ({int(bad.sum())} of {x.numel()} "
                                 f"values differ): {why}")  # fmt: skip
    passed("check_round_float", "FP4 E2M1, FP6 E3M2 and E2M3, E5M2 and three drawn formats, exactly")


# ----------------------------------------------------------------------------- exercise 2: scaled sign
def _ef_reference(grad: torch.Tensor, residual: torch.Tensor, lr: float):
    p = lr * grad + residual
    delta = p.abs().sum() / p.numel() * torch.sign(p)
    return delta, p - delta


def _first_difference(got: torch.Tensor, want: torch.Tensor, p: torch.Tensor, tol: float) -> str:
    """Where a step's tensor first differs: the entry, p there, what came back and what was expected."""
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    i = int(((got - want).abs() > tol).nonzero()[0])
    zero = " (p is exactly 0 there: sign(0) = 0)" if p[i] == 0 else ""
    return f"differs first at entry {i}, where p = {float(p[i]):.6g}: got {float(got[i]):.12g}, expected {float(want[i]):.12g}{zero}"


def check_ef_sign(fn: Callable) -> None:
    """`fn(grad, residual, lr)` -> (delta, new_residual): one step of EF-SignSGD for a 1-D gradient."""
    require_callable(fn, "ef_sign_step")
    targets = {**family(EF_FORBIDDEN_MODULES[0]), **family(*EF_FORBIDDEN_MODULES[1:], missing_ok=True)}
    fn = guarded(fn, targets, "this exercise (ef_sign_step)")
    rnd = random.Random(draw_seed())  # sizes, learning rates and gradients drawn afresh every grade run
    g = torch.Generator().manual_seed(rnd.randrange(2**31))
    for d in (1, 7, rnd.randint(20, 500)):
        lr = (
            1.0 if d == 1 else rnd.choice((0.1, round(rnd.uniform(0.001, 0.5), 4)))
        )  # lr != 1 shows where it goes
        residual = torch.zeros(d, dtype=torch.float64)
        applied = torch.zeros(d, dtype=torch.float64)
        total = torch.zeros(d, dtype=torch.float64)
        for step in range(20 if d > 1 else 3):
            grad = torch.randn(d, generator=g, dtype=torch.float64) * 10.0 ** rnd.randint(-3, 1)
            if d > 1 and step % 5 == 0:
                grad[rnd.randrange(d)] = 0.0  # a zero gradient entry (its residual may not be zero)
            if d > 1 and step == 0:
                grad[0] = 0.0  # and, with no residual yet, an entry whose sum is exactly 0: sign(0) = 0
            where = f"step {step} of a run with d = {d}, lr = {lr}: ef_sign_step(grad, residual, lr={lr})"
            got = call_learner(fn, where, grad.clone(), residual.clone(), lr)
            ok = (
                isinstance(got, (tuple, list))
                and len(got) == 2
                and all(isinstance(t, torch.Tensor) for t in got)
            )
            assert ok, f"{where}: return (delta, new_residual), two tensors; got {type(got).__name__}"
            delta, new = (t.double() for t in got)
            w_delta, w_new = _ef_reference(grad, residual, lr)
            tol = 1e-12 * max(1.0, float(w_delta.abs().max()), float(w_new.abs().max()))
            if delta.shape != w_delta.shape or (delta - w_delta).abs().max() > tol:
                p = lr * grad + residual
                slips = [
                    ((lr * grad).abs().sum() / d * torch.sign(p), "the scale comes from the vector being compressed "
                     "(the step plus the residual), not from the gradient alone."),
                    (p.norm() / math.sqrt(d) * torch.sign(p), "the scale is the mean magnitude (the L1 norm over d), "
                     "not an L2 norm."),
                    (p.norm() * torch.sign(p), "the scale is the mean magnitude (the L1 norm over d), not an L2 norm."),
                    (_ef_reference(grad, torch.zeros_like(grad), lr)[0],
                     "that ignores the residual: what earlier steps did not send is added before compressing."),
                    (lr * (grad + residual).abs().sum() / d * torch.sign(grad + residual),
                     "the learning rate scales the gradient before the residual is added, not the compressed vector."),
                ]  # fmt: skip
                hint = next(
                    (t for x, t in slips if x.shape == delta.shape and (delta - x).abs().max() <= tol), ""
                )
                if hint in (slips[0][1], slips[3][1]):
                    # the two agree wherever sign(p) = sign(grad): a probe with p = [1, -2] tells them apart
                    one, probe = torch.ones(2, dtype=torch.float64), None
                    with contextlib.suppress(Exception):
                        probe = (
                            fn(one, torch.tensor([0.0, -3.0], dtype=torch.float64), 1.0)[0].double().tolist()
                        )
                    hint = {(1.0, 1.0): slips[3][1], (1.0, -1.0): slips[0][1]}.get(tuple(probe or ()), "")
                raise AssertionError(
                    f"{where}: delta {_first_difference(delta, w_delta, p, tol)}. {hint}".rstrip()
                )
            if new.shape != w_new.shape or (new - w_new).abs().max() > tol:
                p = lr * grad + residual
                hint = ""
                if (new - (grad + residual - delta)).abs().max() <= tol and lr != 1.0:
                    hint = (
                        "the residual is in the weights' units: the learning rate goes into the vector that is "
                        "compressed, before the residual is added."
                    )
                elif (new - (lr * grad + residual - torch.sign(lr * grad + residual))).abs().max() <= tol:
                    hint = "the residual keeps what the scaled sign did not carry: p minus delta, not p minus sign(p)."
                elif new.abs().max() <= tol:
                    hint = "the residual must keep what was not sent; zeroing it loses it."
                raise AssertionError(
                    f"{where}: new_residual {_first_difference(new, w_new, p, tol)}. {hint}".rstrip()
                )
            applied += delta
            total += lr * grad
            residual = w_new
        lost = float((applied + residual - total).abs().max())
        assert lost < 1e-9, (
            f"after {step + 1} steps (d = {d}) applied + residual differs from lr·Σgrad by {lost:.3g}"
        )
    passed("check_ef_sign", "3 runs of drawn gradients, step by step, nothing lost")


# ----------------------------------------------------------------------------- exercise 3: margin
def _margin_reference(amaxes: list[float], length: int) -> int:
    need = 0
    for t in range(1, len(amaxes)):
        top = max(amaxes[max(0, t - length) : t])
        k = 0
        while top * 2.0**k < amaxes[t]:  # powers of two are exact: no logarithm rounding
            k += 1
        need = max(need, k)
    return need


def _saturated(amaxes: list[float], fmt: str, length: int, margin: int) -> list[int]:
    """The steps at which the lab's delayed recipe saturates, measured on tensors with those amaxes."""
    from parallel_lab.precision import fp8

    recipe, largest, out = fp8.DelayedScaling(fmt, history=length, margin=margin), fp8.fp8_format(fmt).max, []
    for t, amax in enumerate(amaxes):
        x = torch.tensor([amax, -amax, amax / 3, 0.0], dtype=torch.float32)
        if bool((x.abs() * recipe.scale > largest).any()):
            out.append(t)
        recipe.record(float(x.abs().max()))
    return out


def _amax_runs(rnd: random.Random) -> list[tuple[list[float], str, int]]:
    runs = [([1.0, 1.5, 1.2, 5.0, 4.0, 3.0], "e4m3", 2), ([2.0, 1.0, 0.5], "e5m2", 1),
            ([8.0, 1.0, 1.0, 1.0, 6.0], "e4m3", 2)]  # fmt: skip
    for kind in ("growth", "spike", "decay", "noise"):
        n, amax, seq = rnd.randint(6, 14), 10 ** rnd.uniform(-3, 1), []
        for t in range(n):
            if kind == "growth":
                amax *= rnd.uniform(1.0, 3.0)
            elif kind == "spike":
                amax = amax * rnd.uniform(0.7, 1.3) if t != n // 2 else amax * rnd.uniform(4, 40)
            elif kind == "decay":
                amax *= rnd.uniform(0.3, 1.05)
            else:
                amax *= math.exp(rnd.gauss(0, 0.7))
            seq.append(float(torch.tensor(amax, dtype=torch.float32)))  # an amax a float32 tensor can hold
        runs.append((seq, rnd.choice(("e4m3", "e5m2")), rnd.randint(1, 5)))
    return runs


def check_smallest_margin(fn: Callable) -> None:
    """`fn(amaxes, largest, length)` -> the smallest int margin >= 0 with which delayed scaling never saturates."""
    require_callable(fn, "smallest_margin")
    from parallel_lab.precision import fp8

    fn = guarded(fn, MARGIN_FORBIDDEN, "this exercise (smallest_margin)")
    rnd = random.Random(draw_seed())  # amax sequences drawn afresh every grade run
    for amaxes, fmt, length in _amax_runs(rnd):
        largest = fp8.fp8_format(fmt).max
        shown = [float(f"{a:.4g}") for a in amaxes]
        where = f"smallest_margin(amaxes={shown} (rounded here), largest={largest}, length={length})"
        got = call_learner(fn, where, list(amaxes), largest, length)
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= 200:
            raise AssertionError(
                f"{where} must return an int from 0 to 200 (a margin counts powers of two), got {got!r}"
            )
        want = _margin_reference(amaxes, length)
        at = _saturated(amaxes, fmt, length, got)
        below = _saturated(amaxes, fmt, length, got - 1) if got > 0 else [0]
        assert (want == got) == (not at and bool(below)), (
            "the check's reference disagrees with the measurement"
        )
        if at:
            raise AssertionError(f"{where} = {got}: with that margin the lab's DelayedScaling still saturates at "
                                 f"step(s) {at}; the margin must cover the largest jump of an amax over what "
                                 "the history before it holds.")  # fmt: skip
        if not below:
            raise AssertionError(f"{where} = {got}: margin {got - 1} never saturates either; a margin costs "
                                 "resolution (every value uses 2^-margin of the range), so take the smallest.")  # fmt: skip
    passed("check_smallest_margin", "7 amax sequences, each measured with the margin and one less")
