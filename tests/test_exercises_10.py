"""Lesson 10's checks draw meshes, layer sizes and overlap cases afresh every grade run: an answer table
logged in one run fails the next. (Exercise 3, the dominant terms of four fixed layouts, is a prediction
about named systems: its answer is one dict by design.)"""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def _table_fails(name: str, check: str, missing, match: str) -> None:
    ns = solution_namespace("10")
    real, table = ns[name], {}

    def logging(*args, **kwargs):
        table[args, tuple(sorted(kwargs.items()))] = out = real(*args, **kwargs)
        return out

    ns[name] = logging
    exec(compile(_check_cell("10", check), "<check>", "exec"), ns)  # noqa: S102
    ns[name] = lambda *args, **kwargs: table.get((args, tuple(sorted(kwargs.items()))), missing)
    with pytest.raises(AssertionError, match=match):
        exec(compile(_check_cell("10", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_meshes_fails_the_next():
    _table_fails("mesh_groups", "check_mesh_groups", ({}, {}), "coords")


def test_a_table_of_one_runs_layer_bytes_fails_the_next():
    _table_fails("comm_bytes_per_layer", "check_comm_bytes_per_layer", {"tp": 0, "dp": 0}, "expected")


def test_a_table_of_one_runs_exposed_times_fails_the_next():
    _table_fails("exposed", "check_exposed", -1.0, "expected")
