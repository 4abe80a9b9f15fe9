"""Lesson 02's checks draw sizes and traces afresh every grade run: an answer table logged in one run
fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("02", check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_memory_answers_fails_the_next():
    ns = solution_namespace("02")
    real, table = ns["memory_calculator"], {}

    def logging(n, optimizer, precision):
        table[n, optimizer, precision] = out = real(n, optimizer, precision)
        return out

    ns["memory_calculator"] = logging
    _run(ns, "check_memory_calculator")
    zero = dict.fromkeys(("param", "grad", "optim", "total"), 0)
    ns["memory_calculator"] = lambda n, optimizer, precision: table.get((n, optimizer, precision), zero)
    with pytest.raises(AssertionError, match="should be"):
        _run(ns, "check_memory_calculator")


def test_a_table_of_one_runs_peaks_fails_the_next():
    ns = solution_namespace("02")
    real, table = ns["peak_memory"], {}

    def logging(events):
        table[repr(events)] = out = real(events)
        return out

    ns["peak_memory"] = logging
    _run(ns, "check_peak_memory")
    ns["peak_memory"] = lambda events: table.get(repr(events), (0, {}))
    with pytest.raises(AssertionError, match="random trace"):
        _run(ns, "check_peak_memory")
