"""Lesson 18's checks draw values, gradients and a delayed-scaling run afresh every grade run: an answer
table logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace, table_cheat_fails


def _exec(ns: dict, check: str) -> None:
    exec(compile(_check_cell("18", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_roundings_fails_the_next():
    """Per value: a table of every value one run rounded, answering the rest with the value itself."""
    import torch

    ns = solution_namespace("18")
    real, table = ns["round_e4m3"], {}

    def logging(x):
        out = real(x)
        table.update(zip(x.tolist(), out.tolist()))
        return out

    ns["round_e4m3"] = logging
    _exec(ns, "check_round_e4m3")
    ns["round_e4m3"] = lambda x: torch.tensor([table.get(v, v) for v in x.tolist()])
    with pytest.raises(AssertionError, match="round_e4m3"):
        _exec(ns, "check_round_e4m3")


def test_a_table_of_one_runs_scales_fails_the_next():
    table_cheat_fails("18", "delayed_scale", "check_delayed_scale", (1.0, []), "returned",
                      key=lambda h, a, big, n: (tuple(h), a, big, n))  # fmt: skip
