"""Lesson 14's checks draw queries, keys, values and prompts afresh every grade run: an answer table
logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_table_of_one_runs_attention_outputs_fails_the_next():
    """Keyed by the inputs' bytes; a miss returns zeros."""
    import torch

    ns = solution_namespace("14")
    real, table = ns["online_softmax_attention"], {}

    def key(q, k, v, block):
        return q.numpy().tobytes(), k.numpy().tobytes(), block

    def logging(q, k, v, block):
        table[key(q, k, v, block)] = out = real(q, k, v, block)
        return out

    cell = compile(_check_cell("14", "check_online_softmax_attention"), "<check>", "exec")
    ns["online_softmax_attention"] = logging
    exec(cell, ns)  # noqa: S102
    ns["online_softmax_attention"] = lambda q, k, v, block: table.get(
        key(q, k, v, block), torch.zeros_like(q)
    )
    with pytest.raises(AssertionError, match="differs"):
        exec(cell, ns)  # noqa: S102
