"""Lesson 15's checks draw weights, logits, labels and one setting afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_masks_fails_the_next():
    import torch

    ns = solution_namespace("15")
    real, table = ns["magnitude_mask"], {}

    def logging(weight, sparsity):
        table[weight.numpy().tobytes(), sparsity] = out = real(weight, sparsity)
        return out

    cell = compile(_check_cell("15", "check_magnitude_mask"), "<check>", "exec")
    ns["magnitude_mask"] = logging
    exec(cell, ns)  # noqa: S102
    ns["magnitude_mask"] = lambda w, s: table.get(
        (w.numpy().tobytes(), s), torch.ones_like(w, dtype=torch.bool)
    )
    with pytest.raises(AssertionError):
        exec(cell, ns)  # noqa: S102
