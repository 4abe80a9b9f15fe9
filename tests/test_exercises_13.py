"""Lesson 13's sampler check draws one dataset, seed and set of batch sizes afresh every grade run: a
sampler replaying one run's answers fails the next."""

from __future__ import annotations

import pytest
from solution_code import _check_cell, solution_namespace


def test_a_sampler_replaying_one_run_fails_the_next():
    ns = solution_namespace("13")
    real, table = ns["Sampler"], {}

    class Logging(real):
        def take(self, k):
            out = super().take(k)
            table.setdefault((self.n, self.seed), []).append(out)
            return out

    cell = compile(_check_cell("13", "check_resumable_sampler"), "<check>", "exec")
    ns["Sampler"] = Logging
    exec(cell, ns)  # noqa: S102

    class Replaying:
        def __init__(self, n, seed):
            self.n, self.seed, self.i = n, seed, 0

        def take(self, k):
            runs = table.get((self.n, self.seed), [])
            out = runs[self.i] if self.i < len(runs) else [(0, 0)] * k
            self.i += 1
            return out

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, state):
            self.i = state["i"]

    ns["Sampler"] = Replaying
    with pytest.raises(AssertionError):
        exec(cell, ns)  # noqa: S102
