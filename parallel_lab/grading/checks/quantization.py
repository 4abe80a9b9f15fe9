"""Checks for lesson 12's exercises: absmax quantize/dequantize, int8 matmul with int32 accumulation.

`quantize(x) -> (q, scale)` and `dequantize(q, scale) -> x_hat` are compared with
torch's quantized tensors (`torch.quantize_per_tensor`, symmetric qint8, zero
point 0) given the learner's own scale, so a correct answer matches bit for bit.
`int8_matmul(qa, sa, qb, sb)` is compared with an exact int64 reference; one case
cancels 2 x 66 million to leave 1, which float32 accumulation loses.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

# The lab's int8 code and torch's quantization entry points, switched off while the learner's
# functions run.
FORBIDDEN = {
    **family("parallel_lab.quantization.int8", "parallel_lab.quantization.inference"),
    **{
        f"torch.{n}": ""
        for n in ("quantize_per_tensor", "quantize_per_channel", "_int_mm", "fake_quantize_per_tensor_affine")
    },
    "torch.ao.quantization.quantize_dynamic": "",
}

__all__ = ["check_error_bound", "check_int8_matmul", "check_quantize_absmax"]

_SMALL_X = [[1.2, -0.5, -3.1, 0.8], [0.0, 2.4, -1.7, 0.3], [-0.9, 1.5, 2.0, -2.6]]


def _quant_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(draw_seed())  # the random tensors are drawn afresh every grade run
    return [
        ("a 3x4 example (max |x| = 3.1)", torch.tensor(_SMALL_X)),
        ("ties at k + 0.5 (scale 1.0)", torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0])),
        ("randn(64, 48) * 3", torch.randn(64, 48, generator=g) * 3),
        ("one element", torch.tensor([-0.3])),
        ("3-d, tiny values", torch.randn(4, 5, 6, generator=g) * 1e-3),
        ("an outlier among small values", torch.cat([torch.randn(100, generator=g), torch.tensor([60.0])])),
    ]


def _as_tensor(v, what: str, where: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise AssertionError(f"{where}: {what} must be a torch.Tensor, got {type(v).__name__}")
    return v


def check_quantize_absmax(quantize: Callable, dequantize: Callable) -> None:
    """`quantize(x)` -> (q int8, scale) with scale = max|x| / 127; `dequantize(q, scale)` -> q * scale."""
    require_callable(quantize, "quantize")
    require_callable(dequantize, "dequantize")
    cases = _quant_cases()
    for name, x in cases:
        where = f"case {name!r}"
        out = guarded(quantize, FORBIDDEN, "this exercise (quantize)")(x.clone())
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise AssertionError(f"{where}: quantize must return (q, scale), got {type(out).__name__}")
        q, scale = _as_tensor(out[0], "q", where), out[1]
        scale = float(scale)
        want_scale = float(x.abs().max() / 127)
        assert abs(scale - want_scale) <= 1e-6 * want_scale, (
            f"{where}: scale should be max|x| / 127 = {want_scale:.8g}, got {scale:.8g}"
        )
        assert q.dtype == torch.int8, f"{where}: q must have dtype torch.int8, got {q.dtype}"
        assert q.shape == x.shape, f"{where}: q has shape {tuple(q.shape)}, x has {tuple(x.shape)}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated; still the reference
            ref = torch.quantize_per_tensor(x, scale, 0, torch.qint8)
        want_q, want_x = ref.int_repr(), ref.dequantize()
        wrong = (q != want_q).nonzero()
        if len(wrong):
            i = tuple(wrong[0].tolist())
            ratio = x[i].item() / scale
            raise AssertionError(
                f"{where}: {len(wrong)} wrong int8 value(s); first at index {i}: x = {x[i].item():.6g}, "
                f"x / scale = {ratio:.6g}, got {q[i].item()}, expected {want_q[i].item()} "
                "(round to nearest, ties to even, as torch.round does; clamp to [-127, 127])"
            )
        back = _as_tensor(
            guarded(dequantize, FORBIDDEN, "this exercise (dequantize)")(want_q.clone(), torch.tensor(scale)),
            "dequantize(q, scale)",
            where,
        )
        assert back.shape == x.shape, f"{where}: dequantize returned shape {tuple(back.shape)}"
        diff = (back.float() - want_x).abs()
        assert back.dtype == torch.float32 and diff.max() == 0, (
            f"{where}: dequantize(q, scale) should be q * scale in float32; max abs diff "
            f"{diff.max().item():.3g}, dtype {back.dtype}"
        )
    passed("check_quantize_absmax", f"{len(cases)} tensors match torch.quantize_per_tensor")


def _int64_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long()[:, :, None] * b.long()[None, :, :]).sum(1)


def _matmul_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(draw_seed())  # the random operands are drawn afresh every grade run

    def ri(*shape):
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)

    a = torch.full((2, 8193), 127, dtype=torch.int8)
    a[:, -1] = 1
    b = torch.cat([torch.full((4096,), 127), torch.full((4096,), -127), torch.ones(1)]).to(torch.int8)
    one = torch.tensor(1.0)
    return [
        ("per-tensor scales, (8, 16) @ (16, 5)", ri(8, 16), torch.tensor(0.02), ri(16, 5), torch.tensor(0.5)),
        (
            "sums past int8: all 127 x 127, k = 64",
            torch.full((3, 64), 127, dtype=torch.int8),
            one,
            torch.full((64, 2), 127, dtype=torch.int8),
            one,
        ),  # fmt: skip
        (
            "vector-wise scales (n, 1) and (1, m)",
            ri(6, 32),
            torch.rand(6, 1, generator=g) + 0.01,
            ri(32, 4),
            torch.rand(1, 4, generator=g) + 0.01,
        ),  # fmt: skip
        (
            "127*127*4096 - 127*127*4096 + 1 = 1 (float32 accumulation loses the 1)",
            a,
            one,
            b[:, None].repeat(1, 3),
            one,
        ),  # fmt: skip
    ]


def check_int8_matmul(int8_matmul: Callable) -> None:
    """`int8_matmul(qa, sa, qb, sb)` -> float32 (n, m): int32 accumulation of qa @ qb, times sa * sb."""
    require_callable(int8_matmul, "int8_matmul")
    cases = _matmul_cases()
    for name, qa, sa, qb, sb in cases:
        where = f"case {name!r}"
        got = _as_tensor(
            guarded(int8_matmul, FORBIDDEN, "this exercise (int8_matmul)")(
                qa.clone(), sa.clone(), qb.clone(), sb.clone()
            ),
            "the result",
            where,
        )
        acc = _int64_matmul(qa, qb)  # exact
        want = acc.double() * (sa.double() * sb.double())
        assert got.shape == want.shape, (
            f"{where}: result has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        assert got.dtype == torch.float32, (
            f"{where}: result must be float32 (the rescaled output), got {got.dtype}"
        )
        err = (got.double() - want).abs()
        tol = 1e-6 * want.abs() + 1e-12  # float32 rounding of the rescale only
        bad = (err > tol).nonzero()
        if len(bad):
            i = tuple(bad[0].tolist())
            hint = ""
            if acc.abs().max() > 127:
                hint = (
                    " The integer sums must be exact: convert to torch.int32 before multiplying "
                    "(int8 @ int8 wraps around in int8, float32 rounds sums above 2**24)."
                )
            raise AssertionError(
                f"{where}: {len(bad)} wrong value(s); first at {i}: got {got[i].item():.8g}, expected "
                f"{want[i].item():.8g} (exact integer sum {acc[i].item()} x scales).{hint}"
            )
    passed("check_int8_matmul", f"{len(cases)} cases equal the exact integer reference")


# ----------------------------------------------------------------------------- predict, then measure
def check_error_bound(fn: Callable[[float], float]) -> None:
    """`fn(absmax)` -> the largest error |x - dequantize(quantize(x))| absmax int8 quantization can make
    on a tensor whose largest magnitude is `absmax`; predicted, then measured on dense tensors, where
    the error comes within 1% of the bound: the prediction must hold and be no more than 2% loose."""
    require_callable(fn)
    import random

    from parallel_lab.quantization import dequantize, quantize_absmax

    cases, rnd = 0, random.Random(draw_seed())  # two magnitudes and every tensor drawn afresh every grade run
    for absmax in (
        3.1,
        1.0,
        0.02,
        250.0,
        round(10 ** rnd.uniform(-4, 4), 6),
        round(10 ** rnd.uniform(-4, 4), 6),
    ):
        g = torch.Generator().manual_seed(rnd.getrandbits(62))
        x = (torch.rand(200_000, generator=g) * 2 - 1) * absmax
        x[0] = absmax  # the largest magnitude, exactly
        q, scale = quantize_absmax(x)
        measured = (x - dequantize(q, scale)).abs().max().item()
        said = guarded(fn, FORBIDDEN, "this exercise (error_bound)")(absmax)
        assert isinstance(said, (int, float)) and not isinstance(said, bool), (
            f"error_bound({absmax}) must return a number, got {type(said).__name__}"
        )
        assert said >= measured * (1 - 1e-4), (  # float32 rounding of x / s adds a few ulps
            f"absmax {absmax}: you predict errors up to {said:.6g}, but quantizing made an error of {measured:.6g}"
        )
        assert said <= measured * 1.02, (
            f"absmax {absmax}: you predict errors up to {said:.6g}; the largest measured on 200,000 dense values is "
            f"{measured:.6g}, so your bound is {said / measured:.2f}x loose (round to nearest: how far can x be from "
            "the nearest level?)"
        )
        cases += 1
    passed("check_error_bound", f"{cases} bounds hold and are tight on dense tensors")
