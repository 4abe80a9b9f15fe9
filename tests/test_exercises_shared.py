"""What every lesson's exercises share: the reference solution passes every check, hints come in two levels,
and no lesson prints the code an exercise asks for.

The wrong answers, cheats and answer tables each exercise must reject live with the lesson, in
tests/test_exercises_NN.py.
"""

from __future__ import annotations

import re

import pytest
from solution_code import _cells, check_cells, run_check

LESSONS = [f"{i:02d}" for i in range(1, 22)]


def _own_file_runs(lesson: str, checks: list[str]) -> bool:
    """The lesson's own test file runs its solution through every one of these checks already."""
    from solution_code import REPO

    own = REPO / "tests" / f"test_exercises_{lesson}.py"
    text = own.read_text() if own.exists() else ""
    return "def test_the_solution_passes_with_one_line" in text and all(c in text for c in checks)


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_reference_solution_passes_every_check(lesson, capsys):
    checks = [re.search(r"^(check_\w+)\(", cell, re.M).group(1) for cell in check_cells(lesson)]
    if _own_file_runs(lesson, checks):  # each check runs a second or more: once per suite is enough
        pytest.skip(f"tests/test_exercises_{lesson}.py runs the solution through every check")
    for check in checks:
        run_check(lesson, check)
        assert f"{check} passed" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what a learner sees
def _exercise(lesson: str):
    import nbformat
    from solution_code import REPO

    (path,) = (REPO / "exercises").glob(f"{lesson}_*.ipynb")
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize("lesson", LESSONS)
def test_hints_come_in_two_levels(lesson):
    """The stub names the idea; a folded second hint follows the exercise cell; the lab's own code
    for the exercise (shown in the solution after each check) is not in the exercise notebook."""
    nb = _exercise(lesson)
    stubs = [
        (i, c)
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and "raise NotImplementedError(" in c.source
    ]
    assert len(stubs) >= len(check_cells(lesson))
    for i, cell in stubs:
        after = nb.cells[i + 1]
        assert after.cell_type == "markdown" and after.source.startswith("<details><summary><b>Hint 2</b>"), (
            lesson,
            i,
        )
        first = re.findall(r'raise NotImplementedError\("([^"]*)"\)', cell.source)
        second = after.source.split("</summary>", 1)[1]
        for hint in first:
            assert hint.split(". Hint: ", 1)[1] not in second, "the stub repeats the second hint"
    assert not any("inspect.getsource" in c.source for c in nb.cells), (
        "the lab's answer leaks into the exercise"
    )


def test_no_lesson_prints_the_code_an_exercise_asks_for():
    """A lesson shows the lab's code for a technique, except the functions an exercise asks the learner to
    write: those are printed in the solution notebook, after the exercise."""
    import nbformat
    from solution_code import REPO

    answers = set()
    for lesson in LESSONS:
        for src in _cells(lesson)[0]:
            if "solution-only" in src or "getsource" in src:
                answers |= set(re.findall(r"getsource\(([\w.]+)\)", src))

    def key(dotted: str) -> str:  # "ring.ring_all_reduce" -> "ring_all_reduce"; "Zero3._unit_pre" stays
        parts = dotted.split(".")
        return ".".join(parts[-2:]) if len(parts) > 1 and parts[-2][:1].isupper() else parts[-1]

    answers = {key(a) for a in answers}
    assert {
        "ring_all_reduce",
        "assign_buckets",
        "order_1f1b",
        "int8_matmul",
        "node_limited_topk",
        "biased_topk",
        "update_bias",
        "replicate",
        "balanced_packing",
    } <= answers
    shown = []
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                shown += [
                    (path.name, a)
                    for a in re.findall(r"getsource\(([\w.]+)\)", cell.source)
                    if a.split(".")[-1] in answers
                ]
    assert not shown, shown
