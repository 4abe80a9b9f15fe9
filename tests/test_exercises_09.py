"""Lesson 09's exercises: the reference solution passes, and wrappers of the lab's and torch's
functions, answer tables from an earlier grade run and wrong algorithms fail, each with a message
naming what differed."""

from __future__ import annotations

import pytest
import torch  # noqa: F401
from solution_code import run_check, solution_namespace

from parallel_lab.grading import check_bubble_fraction, check_one_f_one_b

# The reference answers (the solution notebook's code): the lab's own are switched off in a check.
pipeline_bubble_fraction = solution_namespace("09")["bubble_fraction"]
order_1f1b = solution_namespace("09")["one_f_one_b"]

WRONG = [
    ("09", "check_one_f_one_b", "wraps the lab's", "from parallel_lab.pipeline import order_1f1b\ndef one_f_one_b(stage, stages, m):\n    return order_1f1b(stage, stages, m)\n", "switched off"),
    ("09", "check_one_f_one_b", "GPipe instead", "def one_f_one_b(stage, stages, m):\n    return [('F', i) for i in range(m)] + [('B', i) for i in range(m)]\n", "warms up with min"),
    ("09", "check_bubble_fraction", "wraps the lab's", "from parallel_lab.costmodel import pipeline_bubble_fraction as ours\ndef bubble_fraction(p, m, v=1):\n    return ours(p, m, v)\n", "switched off"),
    ("09", "check_bubble_fraction", "forgets the chunks", "def bubble_fraction(p, m, v=1):\n    return (p - 1) / (m + p - 1)\n", "bubble shrinks by v"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("check", "label", "source", "want"), [w[1:] for w in WRONG], ids=[w[2] for w in WRONG]
)
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check("09", check, source)
    assert want in str(info.value), f"{label}: {info.value}"


def test_one_f_one_b_check(capsys):
    check_one_f_one_b(order_1f1b)
    assert "check_one_f_one_b passed" in capsys.readouterr().out
    gpipe = lambda s, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    with pytest.raises(AssertionError, match="warms up with min"):
        check_one_f_one_b(gpipe)

    # a warm-up of p - s + 1 forwards before the first backward (one more than 1F1B's p - s)
    def off_by_one(s, p, m):
        warm = min(p - s + 1, m)
        out = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            out.append(("B", b))
            b += 1
            if f < m:
                out.append(("F", f))
                f += 1
        return out

    with pytest.raises(AssertionError, match="first difference"):
        check_one_f_one_b(off_by_one)
    with pytest.raises(AssertionError, match="each step is"):
        check_one_f_one_b(lambda s, p, m: [("X", 0)])


def test_bubble_fraction_check(capsys):
    check_bubble_fraction(pipeline_bubble_fraction)
    assert "check_bubble_fraction passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="bubble shrinks by v"):
        check_bubble_fraction(lambda p, m, v: (p - 1) / (m + p - 1))
    with pytest.raises(AssertionError, match="bubble-to-compute"):
        check_bubble_fraction(lambda p, m, v: (p - 1) / (v * m))
    with pytest.raises(AssertionError, match="must return a number"):
        check_bubble_fraction(lambda p, m, v: str((p - 1) / (v * m + p - 1)))
