"""Lesson 05's checks draw weights, gradients and one model size afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_offload_bytes_fails_the_next():
    zero = dict.fromkeys(("d2h", "h2d", "host"), 0)
    # the 3-rank model's vocabulary is drawn from 60: a miss within three runs is near certain
    table_cheat_fails("05", "offload_bytes", "check_offload_bytes", zero, "you predict 0 bytes", tries=3)
