"""The graders of lessons 11 and 12 reject wrong answers, and say what went wrong.

A check that every solution passes proves nothing unless it also fails the usual slips. Each
test here feeds one check a right answer (the lab's own implementation, where its signature
fits) and one or more plausible wrong ones, and asserts the AssertionError names the mistake.
"""

from __future__ import annotations

import pytest
import torch
from solution_code import solution_namespace

from parallel_lab.grading.checks.moe import check_top_k_router
from parallel_lab.grading.checks.quantization import check_int8_matmul, check_quantize_absmax

# The reference answers (the solution notebooks' code): the lab's own implementations are
# switched off while a check runs, so a check is handed an answer written like a learner's.
_q12 = solution_namespace("12")
quantize_absmax, dequantize, int8_matmul = _q12["quantize"], _q12["dequantize"], _q12["int8_matmul"]


# ----------------------------------------------------------------------------- lesson 11
def _route(probs, k, capacity, *, choice_major=True):
    n, E = probs.shape
    experts = probs.topk(k, dim=-1).indices  # (N, k)
    slots = torch.full((n, k), -1, dtype=torch.long)
    fill = [0] * E
    order = (
        [(t, j) for j in range(k) for t in range(n)]
        if choice_major
        else [(t, j) for t in range(n) for j in range(k)]
    )
    for t, j in order:
        e = int(experts[t, j])
        if fill[e] < capacity:
            slots[t, j] = fill[e]
            fill[e] += 1
    return experts, slots


def test_top_k_router_check(capsys):
    check_top_k_router(_route)
    assert "check_top_k_router passed" in capsys.readouterr().out
    with pytest.raises(AssertionError):  # token-major: a token's second choice jumps the queue
        check_top_k_router(lambda p, k, c: _route(p, k, c, choice_major=False))
    with pytest.raises(AssertionError):  # capacity ignored: nothing dropped
        check_top_k_router(lambda p, k, c: _route(p, k, 10**6))


# ----------------------------------------------------------------------------- lesson 12
def test_quantize_absmax_check(capsys):
    check_quantize_absmax(quantize_absmax, dequantize)
    assert "check_quantize_absmax passed" in capsys.readouterr().out

    def truncates(x):  # rounds toward zero instead of to nearest
        scale = x.abs().max() / 127
        return (x / scale).trunc().to(torch.int8), scale

    def scale_255(x):  # an asymmetric range's scale on a symmetric quantizer
        scale = x.abs().max() / 255
        return (x / scale).round().clamp(-128, 127).to(torch.int8), scale

    for wrong in (truncates, scale_255):
        with pytest.raises(AssertionError):
            check_quantize_absmax(wrong, dequantize)


def test_int8_matmul_check(capsys):
    check_int8_matmul(int8_matmul)
    assert "check_int8_matmul passed" in capsys.readouterr().out

    def int8_accumulator(qa, sa, qb, sb):  # wraps around long before the sum is done
        return (qa.to(torch.int32) @ qb.to(torch.int32)).to(torch.int8).float() * (sa * sb)

    def one_scale(qa, sa, qb, sb):
        return (qa.to(torch.int32) @ qb.to(torch.int32)).float() * sa

    for wrong in (int8_accumulator, one_scale):
        with pytest.raises(AssertionError):
            check_int8_matmul(wrong)
