"""Lesson 07's checks draw weights, inputs, one spacing and two stack shapes afresh every grade run: an
answer table logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_peaks_fails_the_next():
    ns = solution_namespace("07")
    real, table = ns["peak_saved"], {}

    def logging(layers, linears, segments):
        table[layers, linears, segments] = out = real(layers, linears, segments)
        return out

    cell = compile(_check_cell("07", "check_peak_saved"), "<check>", "exec")
    ns["peak_saved"] = logging
    exec(cell, ns)  # noqa: S102
    ns["peak_saved"] = lambda layers, linears, segments: table.get((layers, linears, segments), 0)
    for _ in range(3):  # two shapes of about 2,600 are drawn per run: a miss in three runs is near certain
        try:
            exec(cell, ns)  # noqa: S102
        except AssertionError as e:
            assert "you predict a peak of 0" in str(e), e
            return
    pytest.fail("three runs in a row drew shapes the table already held")
