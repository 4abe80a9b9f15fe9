"""Lesson 05's checks draw weights, gradients and one model size afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_offload_bytes_fails_the_next():
    ns = solution_namespace("05")
    real, table = ns["offload_bytes"], {}

    def logging(numel, world_size):
        table[numel, world_size] = out = real(numel, world_size)
        return out

    zero = dict.fromkeys(("d2h", "h2d", "host"), 0)
    cell = compile(_check_cell("05", "check_offload_bytes"), "<check>", "exec")
    ns["offload_bytes"] = logging
    exec(cell, ns)  # noqa: S102
    ns["offload_bytes"] = lambda numel, world_size: table.get((numel, world_size), zero)
    for _ in range(3):  # the 3-rank model's vocabulary is one of 60: a miss within three runs is near certain
        try:
            exec(cell, ns)  # noqa: S102
        except AssertionError as e:
            assert "you predict 0 bytes" in str(e), e
            return
    pytest.fail("three runs in a row drew model sizes the table already held")
