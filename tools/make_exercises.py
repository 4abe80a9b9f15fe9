#!/usr/bin/env python
"""Generate exercises/ from solutions/ (nbgrader's convention, without nbgrader).

In a solution notebook, the body of an exercise sits between two lines

    ### BEGIN SOLUTION
    ### HINT: one line that helps      (optional, any number; joined)
    ...the answer...
    ### END SOLUTION

Each block becomes `raise NotImplementedError("exercise N, fn(its args). Hint: hint")` at the
block's indentation; the signature and docstring around it stay. Every output and
execution count is cleared (exercises are stored without outputs, so no answer can
leak through them), cell ids are copied from the solution (the grader matches check
cells by id), and check cells (tag "check") are marked non-deletable/read-only for
JupyterLab. The same input always gives a byte-identical file.

    python tools/make_exercises.py            # write exercises/
    python tools/make_exercises.py --check    # exit 1 naming stale files
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat

from parallel_lab.grading.engine import signature

BEGIN, END, HINT, HINT2 = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:", "### HINT 2:"
# A cell with this tag (e.g. the lab's own code for an exercise) is not copied into the exercise.
SOLUTION_ONLY = "solution-only"
HEADING = re.compile(r"^#+\s*Exercises?\s+(\d+(?:\s*(?:,|and|&)\s*\d+)*)", re.MULTILINE | re.IGNORECASE)
CHECK_TAG = "check"
CHECK_HEADER = "# NBVAL_CHECK_OUTPUT"
REPO = Path(__file__).resolve().parents[1]
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)")
_CLASS = re.compile(r"^(\s*)class\s+(\w+)")


class SolutionFormatError(ValueError):
    """A solution notebook whose markers cannot be turned into an exercise safely."""


def ensure_ids(nb: nbformat.NotebookNode) -> None:
    """Give cells without an id (nbformat < 4.5 files) a deterministic one; the grader does the same."""
    for i, cell in enumerate(nb.cells):
        if not cell.get("id"):
            cell["id"] = f"cell-{i}"
    nb.nbformat, nb.nbformat_minor = 4, max(5, nb.get("nbformat_minor", 5))


def _enclosing_function(lines: list[str], indent: str) -> str | None:
    """Name of the nearest `def` above the block that the block is indented under
    (`Class.method` for a method, so two `forward`s in one cell read apart)."""
    name, depth = None, len(indent)
    for line in reversed(lines):
        m = (_CLASS if name else _DEF).match(line)
        if m and len(m.group(1)) < depth:
            if name:
                return f"{m.group(2)}.{name}"
            name, depth = m.group(2), len(m.group(1))
            if depth == 0:
                return name
    return name


def second_hints(source: str) -> list[str]:
    """The `### HINT 2:` lines of a cell's solution blocks, in order (the text after the marker)."""
    return [ln.strip()[len(HINT2) :].strip() for ln in source.splitlines() if ln.strip().startswith(HINT2)]


def hint_cell(hints: list[str], cell_id: str) -> nbformat.NotebookNode:
    """A markdown cell holding the second hint, folded: the learner opens it only when stuck."""
    body = "\n\n".join(h.replace("*", "\\*") for h in hints)  # b*s*h is a product, not emphasis
    cell = nbformat.v4.new_markdown_cell(
        f"<details><summary><b>Hint 2</b> (open it only if you are stuck)</summary>\n\n{body}\n\n</details>"
    )
    cell["id"] = f"{cell_id}-hint2"[:64]
    return cell


def strip_solutions(source: str, first_number: int | Iterator[int], where: str) -> tuple[str, int]:
    """Replace every marked block in `source`; returns (new source, number of blocks).

    Blocks are named `exercise first_number`, `first_number + 1`, ...; or, given an
    iterator, by the numbers it yields (one per block).
    """
    numbers = itertools.count(first_number) if isinstance(first_number, int) else first_number
    out: list[str] = []
    block: list[str] | None = None
    indent, n = "", 0
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        text = line.strip()
        if text == BEGIN:
            if block is not None:
                raise SolutionFormatError(f"{where}, line {lineno}: '{BEGIN}' inside another block")
            block, indent = [], line[: len(line) - len(line.lstrip())]
        elif text == END:
            if block is None:
                raise SolutionFormatError(f"{where}, line {lineno}: '{END}' without '{BEGIN}'")
            hints = [b.strip()[len(HINT) :].strip() for b in block if b.strip().startswith(HINT)]
            func = _enclosing_function(out, indent)
            # the full signature, so a grade report's "not started" line says which function to write
            name = f"exercise {next(numbers)}" + (f", {signature(out, func) or func}" if func else "")
            hint = " ".join(h for h in hints if h) or (
                f"write the body of {func}" if func else "write this code"
            )
            newline = "\n" if line.endswith("\n") else ""
            message = f"{name}. Hint: {hint}"
            out.append(
                f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)}){newline}"
            )
            block, n = None, n + 1
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    if block is not None:
        raise SolutionFormatError(f"{where}: '{BEGIN}' without '{END}'")
    return "".join(out), n


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook for one solution notebook (the input is not modified)."""
    nb = nbformat.from_dict(json.loads(json.dumps(solution)))  # deep copy
    ensure_ids(nb)
    nb.metadata.pop("widgets", None)  # saved widget state belongs to outputs we drop
    # a block is named after the "Exercise N" heading above it, so the message a learner
    # sees matches the text they are reading; notebooks without such headings count blocks
    headed = any(c.cell_type == "markdown" and HEADING.search(c.source) for c in nb.cells)
    number, under = 1, iter(())  # under: the numbers of the exercise heading above
    nb.cells = [c for c in nb.cells if SOLUTION_ONLY not in c.metadata.get("tags", [])]
    hints_after: dict[str, list[str]] = {}
    for i, cell in enumerate(nb.cells):
        where = f"{name}, cell {i} (id {cell.id})"
        cell.metadata.pop("execution", None)  # timings JupyterLab may record
        if cell.cell_type != "code":
            if headed and (m := HEADING.search(cell.source)):
                # "Exercises 1 and 2": the blocks below are 1, then 2 (the last repeats)
                nums = [int(d) for d in re.findall(r"\d+", m.group(1))]
                under = itertools.chain(nums, itertools.repeat(nums[-1]))
            if BEGIN in cell.source or END in cell.source:
                raise SolutionFormatError(f"{where}: solution markers are only allowed in code cells")
            continue
        cell.outputs, cell.execution_count = [], None
        if CHECK_TAG in cell.metadata.get("tags", []):
            if not cell.source.startswith(CHECK_HEADER):
                raise SolutionFormatError(f"{where}: a check cell must start with '{CHECK_HEADER}'")
            if BEGIN in cell.source:
                raise SolutionFormatError(f"{where}: a check cell must not contain a solution")
            cell.metadata["deletable"], cell.metadata["editable"] = False, False
            continue
        if second := second_hints(cell.source):
            hints_after[cell.id] = second
        cell.source, n = strip_solutions(cell.source, under if headed else number, where)
        number += n
        if "BEGIN SOLUTION" in cell.source or "END SOLUTION" in cell.source:
            raise SolutionFormatError(f"{where}: a solution marker is not on a line of its own")
    cells = []
    for cell in nb.cells:
        cells.append(cell)
        if cell.get("id") in hints_after:
            cells.append(hint_cell(hints_after[cell.id], cell.id))
    nb.cells = cells
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    """Canonical text of a notebook: nbformat's own JSON layout plus a final newline."""
    return nbformat.writes(nb, version=4) + "\n"


def generate(solutions: Path, exercises: Path, check: bool = False) -> list[Path]:
    """Write (or, with `check`, only compare) every exercise; returns the stale/written paths."""
    if not solutions.is_dir():
        raise FileNotFoundError(f"solutions directory not found: {solutions}")
    changed: list[Path] = []
    sources = sorted(solutions.glob("*.ipynb"))
    for src in sources:
        solution = nbformat.read(src, as_version=4)
        text = render(make_exercise(solution, name=src.name))
        dst = exercises / src.name
        if dst.exists() and dst.read_text(encoding="utf-8") == text:
            continue
        changed.append(dst)
        if not check:
            exercises.mkdir(parents=True, exist_ok=True)
            dst.write_text(text, encoding="utf-8", newline="\n")
    wanted = {s.name for s in sources}
    orphans = [p for p in sorted(exercises.glob("*.ipynb")) if p.name not in wanted]
    if check:
        changed += orphans
    for p in orphans:
        print(f"{p}: no solution notebook of that name; delete it", file=sys.stderr)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/make_exercises.py",
        description="Generate exercises/*.ipynb from solutions/*.ipynb by replacing every "
        f"'{BEGIN}' ... '{END}' block with raise NotImplementedError. "
        "Use --check to verify exercises/ is up to date without writing.",
    )
    parser.add_argument(
        "--solutions", type=Path, default=REPO / "solutions", help="folder of solution notebooks"
    )
    parser.add_argument(
        "--exercises", type=Path, default=REPO / "exercises", help="folder to write exercises to"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and name the stale files if exercises/ is out of date",
    )
    args = parser.parse_args(argv)
    try:
        changed = generate(args.solutions, args.exercises, check=args.check)
    except (SolutionFormatError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if changed:
            names = "\n  ".join(str(p) for p in changed)
            print(f"exercises out of date (run python tools/make_exercises.py):\n  {names}", file=sys.stderr)
            return 1
        print(f"exercises up to date ({args.exercises})")
        return 0
    for p in changed:
        print(f"wrote {p}")
    if not changed:
        print(f"exercises already up to date ({args.exercises})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
