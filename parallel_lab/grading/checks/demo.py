"""Checks for the demo exercise (how grading works, shown on the smallest possible task)."""

from __future__ import annotations

from collections.abc import Callable

from parallel_lab.grading.checks import passed, require_callable

__all__ = ["check_add", "check_sum_of_squares"]


def check_add(fn: Callable[[float, float], float]) -> None:
    """`fn(a, b)` must return `a + b`."""
    require_callable(fn)
    cases = [(1, 2), (-3, 3), (0.5, 0.25), (10**6, 1)]
    for a, b in cases:
        got = fn(a, b)
        assert got == a + b, f"add({a}, {b}) returned {got!r}, expected {a + b!r}"
    passed("check_add", f"{len(cases)} cases")


def check_sum_of_squares(fn: Callable[[list[float]], float]) -> None:
    """`fn(xs)` must return the sum of the squares of `xs` (0 for an empty list)."""
    require_callable(fn)
    cases = [[], [3], [1, 2, 3], [-2, 0.5]]
    for xs in cases:
        want = sum(x * x for x in xs)
        got = fn(list(xs))
        assert got == want, f"sum_of_squares({xs}) returned {got!r}, expected {want!r}"
    passed("check_sum_of_squares", f"{len(cases)} cases")
