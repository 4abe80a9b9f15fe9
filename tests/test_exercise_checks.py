"""The grader of lesson 11 rejects wrong answers, and says what went wrong.

A check that every solution passes proves nothing unless it also fails the usual slips. Each
test here feeds one check a right answer (the lab's own implementation, where its signature
fits) and one or more plausible wrong ones, and asserts the AssertionError names the mistake.
"""

from __future__ import annotations

import pytest
import torch

from parallel_lab.grading.checks.moe import check_top_k_router


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
