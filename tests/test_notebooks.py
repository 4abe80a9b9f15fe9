"""Notebook hygiene. notebooks/ and solutions/ are executed by `pytest --nbval-lax notebooks solutions`
(the test command); here: exercises/ is generated and only fails with NotImplementedError,
and every stored notebook reads well and keeps nbval's rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from parallel_lab import grading

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "tests" / "data" / "solutions" / "99_demo.ipynb"
EXERCISES = sorted((REPO / "exercises").glob("*.ipynb"))
STORED = sorted((REPO / "notebooks").glob("*.ipynb")) + sorted((REPO / "solutions").glob("*.ipynb")) + [DEMO]


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_exercises_are_up_to_date():
    tool = REPO / "tools" / "make_exercises.py"
    done = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.fixture(scope="module")
def executed_exercises(request, tmp_path_factory, make_exercises) -> dict:
    """The exercise notebooks this session's tests ask for, each run once in a fresh kernel, two at a
    time (each run is mostly a kernel importing torch and starting ranks): path -> (stored, run, why stopped)."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_exercise_fails_only_with_not_implemented"]  # fmt: skip
    demo = tmp_path_factory.mktemp("demo")
    make_exercises.generate(DEMO.parent, demo)  # the demo's exercise is generated here: always a case

    def run(path: Path) -> tuple:
        src = demo / DEMO.name if path == DEMO else path
        stored = nbformat.read(src, as_version=4)
        nb = nbformat.read(src, as_version=4)
        return stored, nb, grading.execute(nb, cwd=src.parent)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(wanted, pool.map(run, wanted)))


@pytest.mark.parametrize("path", [*EXERCISES, DEMO], ids=_id)
def test_exercise_fails_only_with_not_implemented(path, executed_exercises):
    stored, nb, stopped = executed_exercises[path]
    assert not any(c.get("outputs") for c in stored.cells if c.cell_type == "code"), (
        "exercises are stored without outputs"
    )
    assert not stopped, f"the run stopped early: {stopped}"
    errors = [
        (i, o) for i, c in enumerate(nb.cells) for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert errors, "an exercise notebook must fail somewhere (with NotImplementedError)"
    wrong = [
        f"cell {i}: {o.ename}: {o.evalue.splitlines()[0] if o.evalue else ''}"
        for i, o in errors
        if grading.classify_error(o.ename, o.evalue)[0] != grading.TODO
    ]
    assert not wrong, "errors other than NotImplementedError:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", STORED, ids=_id)
def test_stored_notebook_reads_well(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0] if nb.cells else None
    assert first is not None and first.cell_type == "markdown" and first.source.startswith("# "), (
        "the first cell must be markdown starting with a '# ' title"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any(c.outputs for c in code), "stored without outputs (run it and save it with outputs)"
    problems = []
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        if any(o.output_type == "error" for o in c.outputs):
            problems.append(f"cell {i}: stored with an error output")
        if "NBVAL_CHECK_OUTPUT" in c.source:
            if "clear_output" in c.source:
                problems.append(f"cell {i}: clear_output in an NBVAL_CHECK_OUTPUT cell")
            if any(o.output_type == "stream" and o.name == "stderr" for o in c.outputs):
                problems.append(f"cell {i}: stderr in an NBVAL_CHECK_OUTPUT cell (nbval compares it)")
        if grading.CHECK_TAG in c.metadata.get("tags", []) and not c.source.startswith(
            "# NBVAL_CHECK_OUTPUT"
        ):
            problems.append(f"cell {i}: check cell does not start with '# NBVAL_CHECK_OUTPUT'")
    assert not problems, "\n".join(problems)


WIDGET = "application/vnd.jupyter.widget-view+json"
MAX_WIDTH_PX = 960  # parallel_lab.plots.MAX_WIDTH_PX: the JupyterLab column at 100%


def _png_width(b64: str) -> int:
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).size[0]


@pytest.mark.parametrize("path", sorted((REPO / "notebooks").glob("*.ipynb")), ids=_id)
def test_stored_widgets_carry_a_picture_and_images_fit_the_column(path):
    """A saved lesson shows a picture where a widget was (on a web page, or before the kernel
    runs), and every stored image reads at 100% in JupyterLab's column."""
    nb = nbformat.read(path, as_version=4)
    bare, wide = [], []
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []):
            data = o.get("data", {})
            shows = "image/png" in data or not data.get("text/plain", "<").startswith(
                "<"
            )  # picture or text result
            if WIDGET in data and "interactive" in c.source and not shows:
                bare.append(i)
            if "image/png" in data and _png_width(data["image/png"]) > MAX_WIDTH_PX:
                wide.append((i, _png_width(data["image/png"])))
    assert not bare, f"cells {bare} store a widget view without its picture (or its text result)"
    assert not wide, f"images wider than {MAX_WIDTH_PX} px (cell, width): {wide}"
