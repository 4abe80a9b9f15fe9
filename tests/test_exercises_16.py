"""Lesson 16's check draws three clusters afresh every grade run: an answer table logged in one run fails
the next."""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_times_fails_the_next():
    table_cheat_fails("16", "allreduce_seconds", "check_multinode_all_reduce", 0.0, "expected")
