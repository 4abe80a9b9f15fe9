"""Lesson 11's checks draw router probabilities, routings, tokens, experts and one layer afresh every grade
run: an answer table logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace, table_cheat_fails


def _exec(ns: dict, check: str) -> None:
    exec(compile(_check_cell("11", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_routes_fails_the_next():
    """Keyed by the probabilities' bytes: the next run's probabilities are new."""
    import torch

    ns = solution_namespace("11")
    real, table = ns["route_top_k"], {}

    def key(probs, k, capacity):
        return probs.numpy().tobytes(), k, capacity

    def logging(probs, k, capacity):
        table[key(probs, k, capacity)] = out = real(probs, k, capacity)
        return out

    ns["route_top_k"] = logging
    _exec(ns, "check_top_k_router")

    def from_the_table(probs, k, capacity):
        n = probs.shape[0]
        empty = (torch.zeros(n, k, dtype=torch.long), torch.full((n, k), -1, dtype=torch.long))
        return table.get(key(probs, k, capacity), empty)

    ns["route_top_k"] = from_the_table
    with pytest.raises(AssertionError):
        _exec(ns, "check_top_k_router")


def test_a_table_of_one_runs_dispatch_bytes_fails_the_next():
    # one of about 9,000 layers is drawn per run: a miss within three runs is near certain
    table_cheat_fails(
        "11", "padded_dispatch_bytes", "check_padded_dispatch_bytes", 0, "you predict 0 bytes", tries=3
    )
