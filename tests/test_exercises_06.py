"""Lesson 06's checks draw overflow patterns, weights and thresholds afresh every grade run: an answer
table logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace, table_cheat_fails


def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("06", check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_scales_fails_the_next():
    table_cheat_fails("06", "update_scale", "check_update_scale", (0.0, 0), "expected")


def test_a_table_of_one_runs_thresholds_fails_the_next():
    table_cheat_fails("06", "smallest_update", "check_smallest_update", 1.0, "you predict")


def test_overflow_steps_move_between_runs():
    """A learner who skips the steps one run overflowed on (not the ones holding inf) fails the next."""
    ns = solution_namespace("06")
    real, seen, step = ns["master_weight_step"], set(), [0]

    def logging(params, masters, optimizer, scale):
        out = real(params, masters, optimizer, scale)
        if not out:
            seen.add(step[0] % 60)
        step[0] += 1
        return out

    ns["master_weight_step"] = logging
    _run(ns, "check_master_weight_step")
    assert seen, "the check overflowed on no step"
    calls = [0]

    def from_the_table(params, masters, optimizer, scale):
        k, calls[0] = calls[0] % 60, calls[0] + 1
        if k in seen:
            for m in masters:
                m.grad = None
            return False
        import torch

        for p, m in zip(params, masters):
            m.grad = p.grad.float() / scale
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        return True

    ns["master_weight_step"] = from_the_table
    with pytest.raises(AssertionError, match="step"):
        _run(ns, "check_master_weight_step")
