"""Lesson 03's checks draw a batch, bucket sizes and a parameter list afresh every grade run: an answer
table logged in one run fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace, table_cheat_fails


def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("03", check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_buckets_fails_the_next():
    """Keyed by what a learner can see (the parameters' sizes and the bucket size), answered by position."""
    ns = solution_namespace("03")
    real, table = ns["assign_buckets"], {}

    def key(params, bucket_bytes):
        return tuple(p.numel() for p in params), bucket_bytes

    def logging(params, bucket_bytes):
        out = real(params, bucket_bytes)
        index = {id(p): i for i, p in enumerate(params)}
        table[key(params, bucket_bytes)] = [[index[id(p)] for p in b] for b in out]
        return out

    ns["assign_buckets"] = logging
    _run(ns, "check_assign_buckets")

    def from_the_table(params, bucket_bytes):
        return [[params[i] for i in b] for b in table.get(key(params, bucket_bytes), [])]

    ns["assign_buckets"] = from_the_table
    with pytest.raises(AssertionError, match="bucket_bytes"):
        _run(ns, "check_assign_buckets")


def test_a_table_of_one_runs_byte_predictions_fails_the_next():
    # one bucket size in 200..3000 is drawn per run, and neighbouring sizes can cut the same buckets (then
    # the table's answer is the right one): a few runs make a miss certain in practice
    table_cheat_fails("03", "ddp_bytes", "check_ddp_bytes", 0, "you predict 0 bytes",
                      key=lambda b, p, rank, itemsize: (tuple(b), p, rank, itemsize), tries=4)  # fmt: skip
