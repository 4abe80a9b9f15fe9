"""Lesson 12's exercises: affine (zero-point) quantization per group, the integer product with a zero point
handled outside the product (the lesson quantizes symmetrically), and the worst error of affine quantization.
Each: the solution passes, the wrong algorithms below fail naming the mistake, torch's quantization and the lab's
int8 code are switched off, and an answer table logged in one grade run fails the next."""

from __future__ import annotations

import pytest
from solution_code import edit, run_check, table_cheat_fails


def test_the_solutions_pass(capsys):
    for check in ("check_quantize_affine", "check_int8_matmul_zp", "check_affine_error_bound"):
        run_check("12", check)
    assert capsys.readouterr().out.count(" passed: ") == 3


Q = "quantize_affine"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the range not widened to hold 0: an all-positive group gets no exact zero
        (edit("12", Q, "lo = xg.amin(-1).clamp(max=0.0)", "lo = xg.amin(-1)"), "scale"),
        # 256 steps for 256 codes
        (edit("12", Q, "((hi - lo) / 255)", "((hi - lo) / 256)"), "scale"),
        # the zero point truncated instead of rounded
        (edit("12", Q, "(-torch.round(lo / scale)).to(torch.int64)", "(-lo / scale).to(torch.int64)"), "zero_point"),
        # one scale for the whole tensor
        (edit("12", Q, "lo = xg.amin(-1).clamp(max=0.0)", "lo = xg.amin().clamp(max=0.0).expand(xg.shape[:-1])")
         .replace("hi = xg.amax(-1).clamp(min=0.0)", "hi = xg.amax().clamp(min=0.0).expand(xg.shape[:-1])"), "scale"),
    ],
    ids=["no-zero-in-range", "256-steps", "truncated-zero-point", "per-tensor"],
)  # fmt: skip
def test_wrong_quantizers_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("12", "check_quantize_affine", wrong)


MM = "int8_matmul_zp"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # qa shifted by the zero point before the product (the dequantized-then-multiplied way)
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n"
         "    return ((qa.to(torch.int32) - za) @ qb.to(torch.int32)).float() * (sa * sb)\n", "operands other than"),
        # floats all the way
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n"
         "    return ((qa.float() - za) * sa) @ (qb.float() * sb)\n", "operands other than"),
        # the zero point forgotten
        (edit("12", MM, "acc = acc - za * qb32.sum(0, keepdim=True)", "pass"), "wrong value"),
        # row sums of qa instead of column sums of qb
        (edit("12", MM, "za * qb32.sum(0, keepdim=True)", "za * qa.to(torch.int32).sum(1, keepdim=True)"), "wrong value|size"),
        # an int16 accumulator: wraps long before the sum is done
        (edit("12", MM, "return acc.float() * (sa * sb)", "return acc.to(torch.int16).float() * (sa * sb)"), "wrong value"),
    ],
    ids=["shift-then-multiply", "floats", "no-zero-point", "row-sums", "int16-accumulator"],
)  # fmt: skip
def test_wrong_products_fail(wrong, match):
    with pytest.raises((AssertionError, RuntimeError), match=match):
        run_check("12", "check_int8_matmul_zp", wrong)


@pytest.mark.parametrize(
    "wrong, match",
    [
        (
            "def affine_error_bound(xmin, xmax):\n    return max(abs(xmin), abs(xmax)) / 127 / 2\n",
            "loose|made",
        ),
        ("def affine_error_bound(xmin, xmax):\n    return (xmax - xmin) / 255 / 2\n", "made"),  # 0 left out
        ("def affine_error_bound(xmin, xmax):\n    return (max(xmax, 0) - min(xmin, 0)) / 255\n", "loose"),
    ],
    ids=["symmetric", "range-without-zero", "whole-step"],
)
def test_wrong_bounds_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("12", "check_affine_error_bound", wrong)


@pytest.mark.parametrize(
    "cheat, check",
    [
        ("import torch\ndef quantize_affine(x, group):\n    torch.quantize_per_tensor(x, 1.0, 0, torch.quint8)\n",
         "check_quantize_affine"),
        ("from torch.ao.quantization.observer import MinMaxObserver\ndef quantize_affine(x, group):\n"
         "    MinMaxObserver().calculate_qparams()\n", "check_quantize_affine"),
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n    torch._int_mm(qa, qb)\n", "check_int8_matmul_zp"),
        ("from parallel_lab.quantization import int8\ndef affine_error_bound(xmin, xmax):\n"
         "    int8.absmax_scale(None)\n", "check_affine_error_bound"),
    ],
    ids=["torch-quantize", "torch-observer", "torch-int-mm", "lab-int8"],
)  # fmt: skip
def test_torch_and_lab_quantization_are_switched_off(cheat, check):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("12", check, cheat)


def test_a_table_of_one_runs_bounds_fails_the_next():
    table_cheat_fails("12", "affine_error_bound", "check_affine_error_bound", 0.0, "made", tries=3)
