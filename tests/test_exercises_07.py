"""Lesson 07's checks draw weights, inputs, one spacing and two stack shapes afresh every grade run: an
answer table logged in one run fails the next."""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_peaks_fails_the_next():
    # two shapes of about 2,600 are drawn per run: a miss within three runs is near certain
    table_cheat_fails("07", "peak_saved", "check_peak_saved", 0, "you predict a peak of 0", tries=3)
