"""Lesson 12's checks draw tensors, operands and two magnitudes afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace, table_cheat_fails


def _exec(ns: dict, check: str) -> None:
    exec(compile(_check_cell("12", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_quantized_tensors_fails_the_next():
    ns = solution_namespace("12")
    real, table = ns["quantize"], {}

    def logging(x):
        table[x.numpy().tobytes()] = out = real(x)
        return out

    ns["quantize"] = logging
    _exec(ns, "check_quantize_absmax")
    import torch

    ns["quantize"] = lambda x: table.get(
        x.numpy().tobytes(), (torch.zeros_like(x, dtype=torch.int8), x.abs().max() / 127)
    )
    with pytest.raises(AssertionError):
        _exec(ns, "check_quantize_absmax")


def test_a_table_of_one_runs_bounds_fails_the_next():
    table_cheat_fails("12", "error_bound", "check_error_bound", 0.0, "you predict errors up to 0")
