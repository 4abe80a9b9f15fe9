"""Lesson 08's checks draw weights, inputs and one block shape afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_block_bytes_fails_the_next():
    # one of 84 shapes is drawn per run: a miss within three runs is near certain
    table_cheat_fails("08", "block_bytes", "check_block_bytes", 0, "you predict 0 bytes", tries=3)
