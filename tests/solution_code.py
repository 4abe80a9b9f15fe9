"""The reference answers, read from solutions/*.ipynb: every code cell but the checks, run as the
notebook would run them, in a fresh namespace per lesson (cached)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _cells(lesson: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    (path,) = (REPO / "solutions").glob(f"{lesson}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and not c.source.startswith("# NBVAL_SKIP")]
    checks = tuple(c.source for c in code if "check" in c.metadata.get("tags", []))
    return tuple(c.source for c in code if "check" not in c.metadata.get("tags", [])), checks


def solution_namespace(lesson: str) -> dict:
    """A new namespace holding the lesson's solution code (imports and the learner's functions)."""
    ns: dict = {"__name__": f"solution_{lesson}"}
    for src in _cells(lesson)[0]:
        exec(compile(src, f"<solutions/{lesson} cell>", "exec"), ns)  # noqa: S102 - our own notebooks
    return ns


def check_cells(lesson: str) -> tuple[str, ...]:
    """The lesson's check cells, in order (each calls one `check_*` on the learner's names)."""
    return _cells(lesson)[1]


def _check_cell(lesson: str, check: str) -> str:
    (cell,) = [c for c in check_cells(lesson) if re.search(rf"^{check}\(", c, re.M)]
    return cell


def _solution_cell(lesson: str, name: str) -> str:
    (cell,) = [c for c in _cells(lesson)[0] if re.search(rf"^(?:def|class) {name}\b", c, re.M)]
    return cell


def run_check(lesson: str, check: str, override: str | None = None) -> None:
    ns = solution_namespace(lesson)
    if override is not None:
        exec(compile(override, f"<wrong answer for {check}>", "exec"), ns)  # noqa: S102
    exec(compile(_check_cell(lesson, check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


def edit(lesson: str, name: str, old: str, new: str) -> str:
    """The solution's cell defining `name`, with `old` replaced by `new` (once; it must be there)."""
    src = "\n".join(line for line in _solution_cell(lesson, name).splitlines() if "### HINT" not in line)
    assert old in src, f"{old!r} not in the solution of {name}"
    return src.replace(old, new, 1)
