"""Exercise generation (tools/make_exercises.py), check re-exports and the grading engine.

The grading tests run real kernels on the tiny demo notebook in tests/data/solutions:
two exercises (`add`, `sum_of_squares`), each followed by a check cell.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import parallel_lab.grading.checks
from parallel_lab import grading
from parallel_lab.grading.checks import demo

REPO = Path(__file__).resolve().parents[1]

DEMO = "99_demo.ipynb"
RIGHT_ADD = 'def add(a, b):\n    """Return a + b."""\n    return a + b'
WRONG_ADD = 'def add(a, b):\n    """Return a + b."""\n    return a - b'
RIGHT_SUM = "def sum_of_squares(xs):\n    return sum(x * x for x in xs)"


# ---------------------------------------------------------------------------- helpers
@pytest.fixture
def exercise(tmp_path, make_exercises, demo_solutions):
    """The generated demo exercise, as a notebook to tamper with."""
    make_exercises.generate(demo_solutions, tmp_path / "exercises")
    return nbformat.read(tmp_path / "exercises" / DEMO, as_version=4)


def cell(nb, cell_id):
    return next(c for c in nb.cells if c.id == cell_id)


def write_learner(nb, tmp_path):
    path = tmp_path / "learner" / DEMO
    path.parent.mkdir(exist_ok=True)
    nbformat.write(nb, path)
    return path


def statuses(report):
    return {r.check: r.status for r in report.results}


# ---------------------------------------------------------------------------- check re-exports
def test_every_check_module_is_reexported():
    seen = []
    for info in pkgutil.iter_modules(parallel_lab.grading.checks.__path__):
        module = importlib.import_module(f"parallel_lab.grading.checks.{info.name}")
        assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
        for name in module.__all__:
            assert getattr(grading, name) is getattr(module, name)
            seen.append(name)
    assert grading.check_add is demo.check_add
    assert sorted(seen) == grading.CHECKS and set(grading.CHECKS) <= set(grading.__all__)


def test_demo_checks_pass_fail_and_reject_non_functions(capsys):
    demo.check_add(lambda a, b: a + b)
    assert capsys.readouterr().out == "check_add passed: 4 cases\n"
    with pytest.raises(AssertionError, match=r"add\(1, 2\) returned -1, expected 3"):
        demo.check_add(lambda a, b: a - b)
    with pytest.raises(TypeError, match="fn must be a function"):
        demo.check_sum_of_squares(3)


# ---------------------------------------------------------------------------- make_exercises
def test_strip_solutions_keeps_indentation_signature_and_hint(make_exercises):
    src = (
        "def f(x):\n"
        '    """Doc."""\n'
        "    ### BEGIN SOLUTION\n"
        "    ### HINT: loop over x\n"
        "    for v in x:\n"
        "        pass\n"
        "    return 1\n"
        "    ### END SOLUTION\n"
        "\n"
        "### BEGIN SOLUTION\n"
        "y = 2\n"
        "### END SOLUTION"
    )
    out, n = make_exercises.strip_solutions(src, 3, "nb")
    assert n == 2
    assert out == (
        "def f(x):\n"
        '    """Doc."""\n'
        '    raise NotImplementedError("exercise 3, f(x). Hint: loop over x")\n'
        "\n"
        'raise NotImplementedError("exercise 4. Hint: write this code")'
    )
    compile(out, "cell", "exec")


def test_blocks_are_named_after_the_exercise_heading_above_them(make_exercises):
    """The message a learner sees names the exercise they are reading, and the method it belongs to."""
    nb = nbformat.v4.new_notebook()
    body = "    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
    nb.cells = [
        nbformat.v4.new_markdown_cell("## Exercises 1 and 2: forward and backward"),
        nbformat.v4.new_code_cell(
            f"class Fn:\n  @staticmethod\n  def forward(x):\n{body}\n  def backward(x):\n{body}"
        ),
        nbformat.v4.new_markdown_cell("## Exercise 3: two functions"),
        nbformat.v4.new_code_cell(f"def f(x):\n{body}"),
        nbformat.v4.new_code_cell(f"def g(x):\n{body}"),
    ]
    out = make_exercises.make_exercise(nb)
    code = "".join(c.source for c in out.cells if c.cell_type == "code")
    assert [
        line.split('"')[1].split(". Hint:")[0] for line in code.splitlines() if "NotImplementedError" in line
    ] == [
        "exercise 1, Fn.forward(x)",
        "exercise 2, Fn.backward(x)",
        "exercise 3, f(x)",
        "exercise 3, g(x)",
    ]


@pytest.mark.parametrize(
    "src, rule",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "without '### END SOLUTION'"),
        ("x = 1\n### END SOLUTION\n", "without '### BEGIN SOLUTION'"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another block"),
    ],
)
def test_strip_solutions_rejects_broken_markers(make_exercises, src, rule):
    with pytest.raises(make_exercises.SolutionFormatError, match=rule):
        make_exercises.strip_solutions(src, 1, "nb")


def test_make_exercise_rejects_markers_outside_code_and_unmarked_check_cells(make_exercises):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\nanswer")])
    with pytest.raises(ValueError, match="only allowed in code cells"):
        make_exercises.make_exercise(nb)
    nb.cells = [nbformat.v4.new_code_cell("check_add(add)", metadata={"tags": ["check"]})]
    with pytest.raises(ValueError, match="must start with '# NBVAL_CHECK_OUTPUT'"):
        make_exercises.make_exercise(nb)


def test_exercise_has_no_solution_no_outputs_and_same_ids(exercise, demo_solutions):
    solution = nbformat.read(demo_solutions / DEMO, as_version=4)
    assert [c.id for c in exercise.cells] == [c.id for c in solution.cells]
    assert exercise.nbformat == 4 and exercise.nbformat_minor == 5
    text = json.dumps(exercise)
    assert "return a + b" not in text and "total += x * x" not in text and "SOLUTION" not in text
    assert (
        'raise NotImplementedError(\\"exercise 1, add(a, b). Hint: Python\'s + operator does it\\")' in text
    )
    for c in exercise.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    check = cell(exercise, "ex1-check")
    assert check.source == cell(solution, "ex1-check").source
    assert check.metadata["deletable"] is False and check.metadata["editable"] is False
    assert any(c.outputs for c in solution.cells if c.cell_type == "code")  # the source did have outputs


def test_generation_is_deterministic_and_check_mode_names_stale_files(
    tmp_path, make_exercises, demo_solutions, capsys
):
    args = ["--solutions", str(demo_solutions)]
    out = tmp_path / "ex"
    # the command line once, as the Makefile runs it (a new process imports torch: seconds); the rest in-process
    first = subprocess.run([sys.executable, str(make_exercises.__file__), *args, "--exercises", str(out)],
                           capture_output=True, text=True)  # fmt: skip
    assert first.returncode == 0, first.stderr
    data = (out / DEMO).read_bytes()
    make_exercises.generate(demo_solutions, out)
    assert (out / DEMO).read_bytes() == data
    assert make_exercises.main([*args, "--exercises", str(out), "--check"]) == 0
    (out / DEMO).write_bytes(data.replace(b"exercise 1, add(a, b)", b"exercise 1"))
    (out / "98_orphan.ipynb").write_bytes(data)
    assert make_exercises.main([*args, "--exercises", str(out), "--check"]) == 1
    stderr = capsys.readouterr().err
    assert str(out / DEMO) in stderr and "98_orphan.ipynb" in stderr
    assert b"exercise 1, add(a, b)" not in (out / DEMO).read_bytes()  # --check writes nothing
    with pytest.raises(SystemExit):
        make_exercises.main(["--help"])
    assert "--check" in capsys.readouterr().out


def test_solution_without_ids_gets_stable_ids(tmp_path, make_exercises, demo_solutions):
    raw = json.loads((demo_solutions / DEMO).read_text())
    raw["nbformat_minor"] = 4
    for c in raw["cells"]:
        del c["id"]
    (tmp_path / "sol").mkdir()
    (tmp_path / "sol" / DEMO).write_text(json.dumps(raw))
    make_exercises.generate(tmp_path / "sol", tmp_path / "ex")
    nb = nbformat.read(tmp_path / "ex" / DEMO, as_version=4)
    assert [c.id for c in nb.cells] == [f"cell-{i}" for i in range(len(nb.cells))]
    assert nbformat.validate(nb) is None


# ---------------------------------------------------------------------------- assembling the graded notebook
def test_assemble_restores_deleted_and_edited_check_cells(exercise, demo_solutions):
    solution = grading.engine._read(demo_solutions / DEMO)
    exercise.cells = [c for c in exercise.cells if c.id != "ex1-check"]  # deleted
    cell(exercise, "ex2-check").source = "pass"  # edited
    cell(exercise, "ex2-check").metadata["tags"] = []
    exercise.cells.append(
        nbformat.v4.new_code_cell("print('check_add passed')", metadata={"tags": ["check"]})
    )
    nb, check_ids = grading.assemble(exercise, solution)
    ids = [c.id for c in nb.cells]
    assert check_ids == ["ex1-check", "ex2-check"]
    assert ids == [c.id for c in solution.cells]  # fake check dropped, deleted one back after ex1-add
    assert cell(nb, "ex2-check").source == cell(solution, "ex2-check").source


def test_assemble_anchors_at_the_end_when_no_cell_matches(demo_solutions):
    solution = grading.engine._read(demo_solutions / DEMO)
    learner = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", id="mine")])
    nb, _ = grading.assemble(learner, solution)
    assert [c.id for c in nb.cells] == ["mine", "ex1-check", "ex2-check"]


@pytest.mark.parametrize(
    "ename, evalue, status",
    [
        ("NotImplementedError", "exercise 1, add(a, b). Hint: hint", grading.TODO),
        ("RankError", "rank 1 raised NotImplementedError: exercise 2\n\n--- traceback", grading.TODO),
        ("AssertionError", "rank 0: got 3, expected 4", grading.FAIL),
        ("RankError", "rank 0 raised AssertionError: off by 1", grading.FAIL),
        ("RankError", "rank 0 raised ValueError: bad", grading.ERROR),
        ("NameError", "name 'add' is not defined", grading.ERROR),
        ("KeyboardInterrupt", "", grading.ERROR),
    ],
)
def test_classify_error(ename, evalue, status):
    assert grading.classify_error(ename, evalue)[0] == status


def test_find_solution_looks_beside_the_exercise_folder(tmp_path, demo_solutions):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / DEMO).write_text("{}")
    assert grading.find_solution(tmp_path / "exercises" / DEMO) == tmp_path / "solutions" / DEMO
    assert grading.find_solution(tmp_path / "x" / DEMO, demo_solutions) == demo_solutions / DEMO
    with pytest.raises(FileNotFoundError, match="--solutions"):
        grading.find_solution(tmp_path / "exercises" / "77_none.ipynb")


def test_grade_rejects_bad_arguments(demo_solutions, tmp_path):
    with pytest.raises(ValueError, match=r"path must be a Jupyter notebook \(.ipynb\)"):
        grading.grade(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        grading.grade(demo_solutions / DEMO, timeout=0)
    with pytest.raises(FileNotFoundError, match="notebook not found"):
        grading.grade(tmp_path / DEMO)


# ---------------------------------------------------------------------------- grading with real kernels
def test_solution_passes(demo_solutions):
    report = grading.grade(demo_solutions / DEMO)
    assert report.passed, report.summary()
    assert statuses(report) == {"check_add": "passed", "check_sum_of_squares": "passed"}


def test_wrong_answer_fails_with_the_assertion_message(exercise, tmp_path, demo_solutions):
    cell(exercise, "ex1-add").source = WRONG_ADD
    cell(exercise, "ex2-sum").source = RIGHT_SUM
    report = grading.grade(write_learner(exercise, tmp_path), demo_solutions)
    assert not report.passed
    assert statuses(report) == {"check_add": "failed", "check_sum_of_squares": "passed"}
    assert "add(1, 2) returned -1, expected 3" in report.results[0].message
    assert "add(1, 2) returned -1" in report.summary()


def test_deleted_check_cells_still_run(exercise, tmp_path, demo_solutions):
    # Both checks and the add cell deleted; sum_of_squares is right, add does not exist.
    exercise.cells = [c for c in exercise.cells if c.id not in ("ex1-check", "ex2-check", "ex1-add")]
    cell(exercise, "ex2-sum").source = RIGHT_SUM
    report = grading.grade(write_learner(exercise, tmp_path), demo_solutions)
    assert statuses(report) == {"check_add": "error", "check_sum_of_squares": "passed"}
    assert "NameError" in report.results[0].message and not report.passed


def test_faked_outputs_and_gutted_checks_do_not_pass(exercise, tmp_path, demo_solutions):
    # Stub functions left in place; check 1 shows a stored success line, check 2 was replaced by `pass`
    # and lost its tag. Neither stored outputs nor edited sources count.
    fake = nbformat.v4.new_output("stream", name="stdout", text="check_add passed: 4 cases\n")
    cell(exercise, "ex1-check").outputs = [fake]
    cell(exercise, "ex1-check").execution_count = 2
    cell(exercise, "ex2-check").source = "pass"
    cell(exercise, "ex2-check").metadata = {}
    path = write_learner(exercise, tmp_path)
    before = path.read_bytes()
    report = grading.grade(path, demo_solutions)
    assert statuses(report) == {"check_add": "not started", "check_sum_of_squares": "not started"}
    assert report.results[0].message.startswith("exercise 1, add(a, b)")
    assert path.read_bytes() == before  # grading never writes the learner's file


def test_cli_grade_exit_codes(tmp_path, make_exercises, demo_solutions, repo, capsys):
    make_exercises.generate(demo_solutions, tmp_path / "exercises")
    cli = [sys.executable, "-m", "parallel_lab", "grade", "--solutions", str(demo_solutions)]
    bad = subprocess.run([*cli, str(tmp_path / "exercises" / DEMO)], capture_output=True, text=True, cwd=repo)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "check_add" in bad.stdout and "not started" in bad.stdout and "NOT PASSED" in bad.stdout
    from parallel_lab.__main__ import main

    # the command's own entry point, in-process: a new process would import torch again
    capsys.readouterr()
    assert main(["grade", "--solutions", str(demo_solutions), str(demo_solutions / DEMO)]) == 0
    assert "2 checks: 2 passed" in capsys.readouterr().out
    assert main(["grade", "--solutions", str(demo_solutions), str(tmp_path / "nope.ipynb")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_doctor_and_lessons(tmp_path, repo):
    doctor = subprocess.run([sys.executable, "-m", "parallel_lab", "doctor"], capture_output=True, text=True)
    assert doctor.returncode == 0, doctor.stderr
    for key in (
        "torch",
        "backend",
        "cpu cores",
        "gpus",
        "jupyterlab",
        "ipywidgets",
        "jupyterlab_widgets",
        "accelerate",
    ):
        assert any(line.startswith(key + " ") for line in doctor.stdout.splitlines()), (key, doctor.stdout)
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 05 Offload\n\ntext")])
    nbformat.write(nb, tmp_path / "notebooks" / "05_offload.ipynb")
    cmd = [sys.executable, "-m", "parallel_lab", "--root", str(tmp_path), "lessons"]
    lessons = subprocess.run(cmd, capture_output=True, text=True)
    assert lessons.returncode == 0 and "05_offload.ipynb" in lessons.stdout and "05 Offload" in lessons.stdout


def test_cli_grades_the_real_lesson_01_solution(repo):
    """The README's command on the shipped solution: every check passes, exit status 0. (The untouched
    exercise, graded the same way, is test_grade_shows_the_learners_own_frames_full_messages_and_a_table's.)"""
    checks = sum("check" in c.metadata.get("tags", []) for c in nbformat.read(
        repo / "solutions" / "01_collectives.ipynb", as_version=4).cells)  # fmt: skip
    cli = [sys.executable, "-m", "parallel_lab", "grade"]
    done = subprocess.run([*cli, "solutions/01_collectives.ipynb"], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stdout + done.stderr
    assert checks >= 2 and f"{checks} checks: {checks} passed" in done.stdout, done.stdout


def test_grade_shows_the_learners_own_frames_full_messages_and_a_table(tmp_path):
    """A wrapper of the lab's ring fails naming the switched-off function and the learner's cell and
    line; an unfinished exercise is 'not started'; the table lists every check; exit status 1."""
    nb = nbformat.read(REPO / "exercises" / "01_collectives.ipynb", as_version=4)
    for c in nb.cells:
        if c.cell_type == "code" and "def ring_all_gather_v" in c.source:
            c.source = (
                "def ring_all_gather_v(ctx, tensor, sizes):\n    return comms.ring_all_gather(ctx, tensor)\n"
            )
    (tmp_path / "exercises").mkdir()
    path = tmp_path / "exercises" / "01_collectives.ipynb"
    nbformat.write(nb, path)
    done = subprocess.run([sys.executable, "-m", "parallel_lab", "grade", str(path), "--solutions",
                           str(REPO / "solutions")], capture_output=True, text=True, timeout=600)  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "parallel_lab.comms.ring.ring_all_gather is switched off while the check runs" in out
    cell = 'cell [4] "def ring_all_gather_v(ctx, tensor, sizes):"'  # as JupyterLab numbers it after Run All
    assert f"{cell}, line 2, in ring_all_gather_v: return comms.ring_all_gather(ctx, tensor)" in out
    # the failing check cell, and the full signature of the function it grades
    assert (
        '--- check 2, check_ring_all_gather_v: failed (the check is cell [5] "check_ring_all_gather_v(ring_all_gather_v)")'
        in out
    )
    assert f"it grades ring_all_gather_v(ctx, tensor, sizes), defined in {cell}" in out
    assert "exercise 1, torus_all_reduce(ctx, tensor, rows). Hint: " in out  # a stub says what to write
    assert out.count("your code:") == 1, "an unfinished exercise shows no frame (the stub's raise is no news)"
    assert "grading/" not in out and "checks/" not in out, "no frame of the grader's own code"
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "check_" in line]
    assert [r[1:] for r in rows] == [["check_torus_all_reduce", "not", "started"],
                                     ["check_ring_all_gather_v", "failed"],
                                     ["check_all_to_all_v", "not", "started"],
                                     ["check_torus_bytes", "not", "started"]], out  # fmt: skip
    assert out.rstrip().endswith("NOT PASSED")


@pytest.mark.parametrize("what", ["text file", "not json", "a lesson notebook"])
def test_grading_something_that_is_not_the_exercise_is_one_line(tmp_path, what):
    import shutil

    (tmp_path / "exercises").mkdir()
    if what == "text file":
        path = tmp_path / "exercises" / "01_collectives.txt"
        path.write_text("hello")
    elif what == "not json":
        path = tmp_path / "exercises" / "01_collectives.ipynb"
        path.write_text("hello")
    else:
        path = tmp_path / "exercises" / "03_data_parallel.ipynb"
        shutil.copy(REPO / "notebooks" / "03_data_parallel.ipynb", path)
    done = subprocess.run([sys.executable, "-m", "parallel_lab", "grade", str(path), "--solutions",
                           str(REPO / "solutions")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert {
        "text file": ".ipynb",
        "not json": "not a Jupyter notebook",
        "a lesson notebook": "is not the exercise notebook",
    }[what] in lines[0]


def test_make_grade_prints_the_report_without_makes_own_error_line(tmp_path):
    """`make grade` on a notebook that does not pass shows the report and its verdict, and no
    `make: *** [...] Error 1` after it (the learner acts on the report, not on make)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    path = tmp_path / "exercises" / "02_memory.ipynb"  # unfinished: its checks come from solutions/
    path.parent.mkdir()
    shutil.copy(REPO / "exercises" / "02_memory.ipynb", path)
    done = subprocess.run(["make", "-s", "-C", str(REPO), "grade", f"NB={path}"], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    out = done.stdout + done.stderr
    assert "NOT PASSED" in out and "make:" not in out and "Error 1" not in out, out
