"""Lesson 08's checks draw weights, inputs and one block shape afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_block_bytes_fails_the_next():
    ns = solution_namespace("08")
    real, table = ns["block_bytes"], {}

    def logging(*args):
        table[args] = out = real(*args)
        return out

    cell = compile(_check_cell("08", "check_block_bytes"), "<check>", "exec")
    ns["block_bytes"] = logging
    exec(cell, ns)  # noqa: S102
    ns["block_bytes"] = lambda *args: table.get(args, 0)
    for _ in range(3):  # one of 84 shapes is drawn per run: a miss within three runs is near certain
        try:
            exec(cell, ns)  # noqa: S102
        except AssertionError as e:
            assert "you predict 0 bytes" in str(e), e
            return
    pytest.fail("three runs in a row drew shapes the table already held")
