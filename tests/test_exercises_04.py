"""Lesson 04's checks draw weights, gradients and one model size afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_state_bytes_fails_the_next():
    ns = solution_namespace("04")
    real, table = ns["zero_state_bytes"], {}

    def logging(numel, world_size, stage):
        table[numel, world_size, stage] = out = real(numel, world_size, stage)
        return out

    zero = dict.fromkeys(("param", "grad", "optim"), 0)
    cell = compile(_check_cell("04", "check_zero_state_bytes"), "<check>", "exec")
    ns["zero_state_bytes"] = logging
    exec(cell, ns)  # noqa: S102
    ns["zero_state_bytes"] = lambda numel, world_size, stage: table.get((numel, world_size, stage), zero)
    # the 3-rank model's vocabulary is drawn per run: a couple of runs make a miss certain in practice
    for _ in range(3):
        try:
            exec(cell, ns)  # noqa: S102
        except AssertionError as e:
            assert "you predict 0 bytes" in str(e), e
            return
    pytest.fail("three runs in a row drew model sizes the table already held")
