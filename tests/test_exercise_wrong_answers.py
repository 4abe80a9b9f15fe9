"""Every exercise check passes the reference solution and rejects known-wrong answers, each with a
message naming what differed.

The wrong answers are of four kinds: a wrapper of the lab's own implementation (switched off while
the check runs, also when imported under another name first), a wrapper of the torch built-in
(switched off too, or caught by the algorithm's signature), an off-by-one or wrong index, and a
wrong sign, order or factor. Each is the learner's cell: either a whole new definition, or the
solution's cell with one edit. The check cell then runs exactly as in the notebook.
"""

from __future__ import annotations

import re

import pytest
from solution_code import _cells, check_cells, edit, run_check

LESSONS = [f"{i:02d}" for i in range(1, 19)]
P = "import torch\nimport torch.distributed as dist\nfrom parallel_lab import comms\n"


# (lesson, check, label, the learner's cell, what the message must say)
WRONG = [
    # ---- 01 collectives: tests/test_exercises_01.py
    # ---- 02 memory: tests/test_exercises_02.py
    # ---- 03 data parallel: tests/test_exercises_03.py
    # ---- 04 ZeRO: tests/test_exercises_04.py
    # ---- 05 offload: tests/test_exercises_05.py
    # ---- 06 mixed precision: tests/test_exercises_06.py
    # ---- 07 checkpointing: tests/test_exercises_07.py
    # ---- 08 tensor parallel: tests/test_exercises_08.py
    # ---- 10 3D: tests/test_exercises_10.py
    # ---- 11 MoE
    ("11", "check_top_k_router", "token-major order", edit("11", "route_top_k", "    for c in range(k):  # first choices of every token before any second choice\n        for t in range(n):",
     "    for t in range(n):\n        for c in range(k):"), "slot"),
    ("11", "check_top_k_router", "wraps the lab's router", '''
import torch
from parallel_lab.moe import routing
def route_top_k(probs, k, capacity):
    return routing.assign_slots(probs, k, capacity)
''', "switched off"),
    ("11", "check_dispatch_combine", "forgets the gate", edit("11", "dispatch_combine", "expert_gates[e, m, None] * back[e, m]", "back[e, m]"), "differs"),
    ("11", "check_padded_dispatch_bytes", "its own experts travel too", edit("11", "padded_dispatch_bytes", "(p - 1) * (experts // p)", "p * (experts // p)"), "the dispatch sent"),
    ("11", "check_padded_dispatch_bytes", "capacity rounded down", edit("11", "padded_dispatch_bytes", "C = math.ceil(", "C = math.floor("), "the dispatch sent"),
    ("11", "check_padded_dispatch_bytes", "the lab's capacity", "from parallel_lab.moe import expert_capacity\ndef padded_dispatch_bytes(n, E, k, f, d, p, i):\n    return (p - 1) * (E // p) * expert_capacity(n, E, f, k) * d * i\n", "switched off"),
    # ---- 12 quantization: tests/test_exercises_12.py
    ("11", "check_dispatch_combine", "wraps the lab's layer", P + "from parallel_lab.moe import expert_parallel as ep\ndef dispatch_combine(ctx, x, expert_tokens, expert_gates, experts):\n    return ep.ExpertParallelMoE._exact(None, x)\n", "switched off"),
    # ---- 13 fault tolerance: tests/test_exercises_13.py
    # ---- 14 inference: tests/test_exercises_14.py
    # ---- 15 compression: tests/test_exercises_15.py
    # ---- 16 scaling out: tests/test_exercises_16.py
    # ---- 18 fewer bytes: tests/test_exercises_18.py
]  # fmt: skip


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_reference_solution_passes_every_check(lesson, capsys):
    for cell in check_cells(lesson):
        check = re.search(r"^(check_\w+)\(", cell, re.M).group(1)
        run_check(lesson, check)
        assert f"{check} passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("lesson", "check", "label", "source", "want"), WRONG, ids=[f"{w[1]}-{w[2]}" for w in WRONG]
)
def test_a_wrong_answer_fails_saying_what_differed(lesson, check, label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check(lesson, check, source)
    assert want in str(info.value), f"{label}: {info.value}"


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
    assert {"ring_all_reduce", "assign_buckets", "order_1f1b", "int8_matmul"} <= answers
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
