"""The reference answers, read from solutions/*.ipynb: every code cell but the checks, run as the
notebook would run them, in a fresh namespace per lesson (cached)."""

from __future__ import annotations

import functools
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
