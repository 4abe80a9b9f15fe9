"""Lesson 10's checks draw meshes, layer sizes and overlap cases afresh every grade run: an answer table
logged in one run fails the next. (Exercise 3, the dominant terms of four fixed layouts, is a prediction
about named systems: its answer is one dict by design.)"""

from __future__ import annotations

from solution_code import table_cheat_fails


def test_a_table_of_one_runs_meshes_fails_the_next():
    table_cheat_fails("10", "mesh_groups", "check_mesh_groups", ({}, {}), "coords")


def test_a_table_of_one_runs_layer_bytes_fails_the_next():
    table_cheat_fails(
        "10", "comm_bytes_per_layer", "check_comm_bytes_per_layer", {"tp": 0, "dp": 0}, "expected"
    )


def test_a_table_of_one_runs_exposed_times_fails_the_next():
    table_cheat_fails("10", "exposed", "check_exposed", -1.0, "expected")
