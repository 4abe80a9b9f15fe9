"""Lesson 16's check draws three clusters afresh every grade run: an answer table logged in one run fails
the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_times_fails_the_next():
    ns = solution_namespace("16")
    real, table = ns["allreduce_seconds"], {}

    def logging(*args):
        table[args] = out = real(*args)
        return out

    cell = compile(_check_cell("16", "check_multinode_all_reduce"), "<check>", "exec")
    ns["allreduce_seconds"] = logging
    exec(cell, ns)  # noqa: S102
    ns["allreduce_seconds"] = lambda *args: table.get(args, 0.0)
    with pytest.raises(AssertionError, match="expected"):
        exec(cell, ns)  # noqa: S102
