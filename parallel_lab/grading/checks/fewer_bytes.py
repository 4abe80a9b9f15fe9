"""Checks for lesson 18's exercises: rounding to E4M3 from its bit layout, and top-k with error feedback.

`round_e4m3(x)` is compared bit for bit with the nearest E4M3 value on every value of the format, the
midpoints between neighbours (ties go to the even mantissa), their neighbours, subnormals and values
beyond 448 (which saturate); no float8 tensor may be created while it runs (that would be torch's
cast doing the work). `topk_error_feedback(grad, residual, k)` is compared with a hand computation,
then run for 20 steps: what it sent plus what it still holds must equal every gradient it was given,
which fails for a version that drops the residual or sends an entry twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

FORBIDDEN = family("parallel_lab.precision.fp8", "parallel_lab.precision.fp8_linear")
TOPK_FORBIDDEN = family("parallel_lab.data_parallel.compression")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

__all__ = ["check_round_e4m3", "check_topk_error_feedback"]


class _NoFp8(TorchDispatchMode):
    """Fails the check when an op produces a float8 tensor: the exercise is the rounding itself."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype in _FP8 for t in tree_leaves(out)):
            raise AssertionError(
                f"round_e4m3 made a float8 tensor ({func}): torch's cast would do the rounding for you; "
                "compute the nearest E4M3 value with float32 arithmetic"
            )
        return out


def _grid() -> torch.Tensor:
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[torch.isfinite(every)].unique()  # every finite E4M3 value
    mids = (every[1:] + every[:-1]) / 2
    inf = torch.tensor(float("inf"))
    return torch.cat([every, mids, mids.nextafter(inf), mids.nextafter(-inf),
                      torch.tensor([460.0, 464.0, 500.0, 1e6, -1e6, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-9])])  # fmt: skip


def check_round_e4m3(round_e4m3: Callable) -> None:
    """`round_e4m3(x)` -> float32 tensor of the nearest E4M3 value of each x (ties to even), saturated at ±448."""
    require_callable(round_e4m3, "round_e4m3")
    fn = guarded(round_e4m3, FORBIDDEN, "this exercise (round_e4m3)")
    g = torch.Generator().manual_seed(draw_seed())  # plus 4,096 values drawn afresh every grade run
    x = torch.cat(
        [_grid(), torch.randn(4096, generator=g) * 10.0 ** torch.randint(-4, 3, (4096,), generator=g)]
    )
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # torch's cast, inside the range: the reference
    with _NoFp8():
        got = fn(x.clone())
    assert isinstance(got, torch.Tensor) and got.shape == x.shape, (
        f"return a tensor of the input's shape {tuple(x.shape)}; got "
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
    )
    got = got.float()
    bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    if bad.any():
        i = int(bad.nonzero()[0])
        v, g, w = float(x[i]), float(got[i]), float(want[i])
        if abs(v) > 448:
            why = "values beyond 448 saturate to ±448 (E4M3 has no infinity)"
        elif abs(v) < 2.0**-6:
            why = "below 2^-6 the numbers are subnormal: the spacing stays 2^-9 down to 0"
        elif float(mids_of(v)) == v:
            why = "a value halfway between two neighbours goes to the one whose last mantissa bit is 0 (ties to even)"
        else:
            why = "E4M3 keeps 3 mantissa bits: around 2^e the spacing is 2^(e-3)"
        raise AssertionError(
            f"round_e4m3({v!r}) = {g!r}, expected {w!r} ({int(bad.sum())} of {x.numel()} values differ): {why}"
        )
    passed("check_round_e4m3", f"{x.numel()} values bit for bit, ties, subnormals and saturation")


def mids_of(v: float) -> float:
    """v itself when it is the midpoint of two neighbouring E4M3 values, else nan."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[torch.isfinite(every)].unique()
    mids = (every[1:] + every[:-1]) / 2
    return v if bool((mids == v).any()) else float("nan")


def _reference(grad: torch.Tensor, residual: torch.Tensor, k: int):
    acc = grad + residual
    idx = acc.abs().topk(k).indices
    new = acc.clone()
    new[idx] = 0
    return idx, acc[idx], new


def _unpack(got, what: str):
    ok = isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)
    assert ok, f"{what}: return (indices, values, new_residual), three tensors; got {type(got).__name__}"
    return got


def check_topk_error_feedback(topk_error_feedback: Callable) -> None:
    """`topk_error_feedback(grad, residual, k)` -> (indices, values, new_residual) for a 1-D gradient."""
    require_callable(topk_error_feedback, "topk_error_feedback")
    fn = guarded(topk_error_feedback, TOPK_FORBIDDEN, "this exercise (topk_error_feedback)")
    grad = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2, 0.0, 1.0, 0.3])
    residual = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0])
    what = "topk_error_feedback(grad=[0.5, -3, 0.1, 2, -0.2, 0, 1, 0.3], residual=[0, 0, 0, 0, 0, 0, 1.5, 0], k=2)"
    idx, vals, new = _unpack(fn(grad.clone(), residual.clone(), 2), what)
    order = idx.long().argsort()
    got = (
        sorted(idx.long().tolist()),
        [round(float(v), 4) for v in vals[order]],
        [round(float(v), 4) for v in new],
    )
    want = ([1, 6], [-3.0, 2.5], [0.5, 0.0, 0.1, 2.0, -0.2, 0.0, 0.0, 0.3])
    if got != want:
        if got[0] == [1, 3]:
            hint = (
                "the residual from earlier steps must be added before choosing: index 6 holds 1 + 1.5 = 2.5"
            )
        elif got[2] == [0.5, -3.0, 0.1, 2.0, -0.2, 0.0, 2.5, 0.3]:
            hint = (
                "the new residual keeps the entries sent: they must be zeroed there, or they are sent twice"
            )
        else:
            hint = "expected indices [1, 6], values [-3, 2.5], residual [0.5, 0, 0.1, 2, -0.2, 0, 0, 0.3]"
        raise AssertionError(f"{what} returned indices {got[0]}, values {got[1]}, residual {got[2]}: {hint}")
    g = torch.Generator().manual_seed(draw_seed())  # gradients drawn afresh every grade run
    residual, total_in, total_out = torch.zeros(500), torch.zeros(500), torch.zeros(500)
    for step in range(20):
        grad = torch.randn(500, generator=g) * 0.1 ** (step % 3)
        w_idx, w_vals, w_new = _reference(grad, residual, 10)
        idx, vals, new = _unpack(fn(grad.clone(), residual.clone(), 10), f"step {step}")
        assert idx.numel() == 10 and vals.numel() == 10, (
            f"step {step}: send exactly k = 10 entries, sent {idx.numel()}"
        )
        assert set(idx.long().tolist()) == set(w_idx.tolist()), (
            f"step {step}: sent indices {sorted(idx.long().tolist())}, expected the 10 largest |grad + residual| "
            f"{sorted(w_idx.tolist())}"
        )
        total_in += grad
        total_out.index_add_(0, idx.long(), vals.float())
        residual = new
    lost = float((total_out + residual - total_in).abs().max())
    assert lost < 1e-4, (
        f"after 20 steps, what was sent plus what is still held differs from the sum of the gradients by up to "
        f"{lost:.3g}: error feedback loses nothing, every entry is either sent or kept"
    )
    passed("check_topk_error_feedback", "a step by hand and 20 steps that lose nothing")


def check_delayed_scale(delayed_scale: Callable) -> None:
    """`delayed_scale(history, amax, largest, length)` -> (scale, new_history): delayed scaling's one step."""
    require_callable(delayed_scale, "delayed_scale")
    fn = guarded(delayed_scale, FORBIDDEN, "this exercise (delayed_scale)")
    steps = [(3.0, 1.0), (12.0, 448.0 / 3.0), (5.0, 448.0 / 12.0), (1.0, 448.0 / 12.0), (2.0, 448.0 / 12.0),
             (0.5, 448.0 / 5.0), (0.25, 448.0 / 2.0)]  # (this step's amax, the scale it must use), length 3  # fmt: skip
    history: list = []
    import random

    rnd = random.Random(
        draw_seed()
    )  # then a run with its own length, format limit and amaxes, drawn per grade run
    for i, (amax, want) in enumerate(steps):
        what = f"step {i}: delayed_scale(history={history}, amax={amax}, largest=448.0, length=3)"
        got = fn(list(history), amax, 448.0, 3)
        ok = isinstance(got, (tuple, list)) and len(got) == 2
        assert ok, f"{what}: return (scale, new_history); got {got!r}"
        scale, new = float(got[0]), list(got[1])
        if abs(scale - want) > 1e-9 * want:
            with_current = 448.0 / max(history + [amax])
            if abs(scale - with_current) < 1e-9 * with_current and (not history or amax > max(history)):
                hint = (
                    "this step's amax went into its own scale: delayed scaling takes the scale from earlier "
                    "steps only, and records this amax for the next ones"
                )
            elif not history:
                hint = "with no history yet the scale is 1.0"
            else:
                hint = f"expected largest / max(history) = 448 / {max(history)} = {want:.4g}"
            raise AssertionError(f"{what} returned scale {scale:.6g}: {hint}")
        want_hist = (history + [amax])[-3:]
        assert [float(v) for v in new] == want_hist, (
            f"{what} returned history {new}, expected {want_hist}: append this step's amax and keep the last "
            "`length` (older ones fall out, so a spike is forgotten after `length` steps)"
        )
        history = want_hist
    length, largest, history = rnd.randint(1, 6), rnd.choice((448.0, 57344.0, 240.0)), []
    for i in range(12):
        amax = round(10 ** rnd.uniform(-3, 3), 6)
        want = largest / max(history) if history else 1.0
        what = f"step {i}: delayed_scale(history={history}, amax={amax}, largest={largest}, length={length})"
        got = fn(list(history), amax, largest, length)
        assert isinstance(got, (tuple, list)) and len(got) == 2, (
            f"{what}: return (scale, new_history); got {got!r}"
        )
        assert abs(float(got[0]) - want) <= 1e-9 * want, (
            f"{what} returned scale {float(got[0]):.6g}, expected {want:.6g}"
        )
        want_hist = (history + [amax])[-length:]
        assert [float(v) for v in got[1]] == want_hist, (
            f"{what} returned history {list(got[1])}, expected {want_hist}"
        )
        history = want_hist
    passed("check_delayed_scale", f"{len(steps)} steps with a history of 3, 12 with a drawn length")


__all__ += ["check_delayed_scale"]
