"""Lesson 02's checks draw sizes and traces afresh every grade run: an answer table logged in one run
fails the next."""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_memory_answers_fails_the_next():
    zero = dict.fromkeys(("param", "grad", "optim", "total"), 0)
    table_cheat_fails("02", "memory_calculator", "check_memory_calculator", zero, "should be")


def test_a_table_of_one_runs_peaks_fails_the_next():
    table_cheat_fails("02", "peak_memory", "check_peak_memory", (0, {}), "random trace", key=repr)
