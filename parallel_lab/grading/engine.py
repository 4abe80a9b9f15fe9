"""Grading: the `check_*` functions check cells call, and the engine behind
`python -m parallel_lab grade exercises/NN_topic.ipynb`.

Every `check_*` in `parallel_lab/grading/checks/<lesson>.py` (its `__all__`) is re-exported
here, so a check cell reads `from parallel_lab.grading import check_torus_all_reduce`.

The engine's invariant: a grade depends only on running the learner's code against
the teacher's checks, never on what the learner's file stores. So it takes the
check cells from the pristine solution notebook of the same name (matched by cell
id and the "check" tag), drops whatever the learner's file has in their place
(edited, emptied, faked outputs), puts each canonical check where the learner's
copy sat (or, if deleted, after the nearest cell that precedes it in the
solution), clears every output, runs the whole notebook in a fresh kernel with this
interpreter, and reads each check cell's outcome. It is not a sandbox: the
learner's code runs with the learner's rights.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import parallel_lab.grading.checks as _checks_pkg

CHECK_TAG = "check"
PASS, FAIL, TODO, ERROR = "passed", "failed", "not started", "error"
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- check re-exports
def _export_checks() -> list[str]:
    """Import every module in parallel_lab/grading/checks/ and lift its `__all__` into this module."""
    origin: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(_checks_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_checks_pkg.__name__}.{info.name}")
        names = getattr(module, "__all__", None)
        if names is None:
            raise ImportError(f"{module.__name__} must define __all__ (the check_* names it exports)")
        for name in names:
            if name in origin:
                raise ImportError(f"{name} is defined by both {origin[name]} and {module.__name__}")
            origin[name] = module.__name__
            globals()[name] = getattr(module, name)
    return sorted(origin)


CHECKS = _export_checks()


# ---------------------------------------------------------------------------- report
def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it (shorter tables)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass
class CheckResult:
    """Outcome of one check cell: status is one of pass / fail / not implemented / error."""

    cell_id: str
    check: str
    status: str
    message: str = ""
    where: list[str] = field(
        default_factory=list
    )  # the learner's own frames: 'cell [4] "def f(x):", line 12, ...'
    cell: str = ""  # the check cell as JupyterLab shows it: 'cell [9] "check_f(f)"'
    checks: list[str] = field(default_factory=list)  # what it grades: 'f(x, y=1), defined in cell [4]'


@dataclass
class GradeReport:
    notebook: Path
    solution: Path
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True only when there is at least one check and every check passed."""
        return bool(self.results) and all(r.status == PASS for r in self.results)

    def summary(self) -> str:
        """What a learner reads: for each check that did not pass, its whole message and where in
        their own cells it happened; then one row per check; then the verdict."""
        lines = [f"Grading {_shown(self.notebook)} (checks from {_shown(self.solution)})"]
        if any(r.status != PASS for r in self.results):
            lines += [
                "cells are named by the number JupyterLab shows beside them after Kernel > Restart Kernel and Run "
                "All Cells, and by their first line"
            ]
        for i, r in enumerate(self.results, 1):
            if r.status == PASS:
                continue
            lines += [
                "",
                f"--- check {i}, {r.check}: {r.status}" + (f" (the check is {r.cell})" if r.cell else ""),
            ]
            lines += [f"it grades {g}" for g in r.checks]
            lines += [r.message.strip()] if r.message.strip() else []
            if r.where:
                lines += ["your code:", *(f"  {w}" for w in r.where)]
        width = max([len(r.check) for r in self.results] + [5])
        lines += ["", f"  {'#':>2}  {'check':<{width}}  result"]
        lines += [f"  {i:>2}  {r.check:<{width}}  {r.status}" for i, r in enumerate(self.results, 1)]
        counts = {s: sum(r.status == s for r in self.results) for s in (PASS, FAIL, TODO, ERROR)}
        lines += [
            "",
            f"{len(self.results)} check{'s' if len(self.results) != 1 else ''}: "
            + ", ".join(f"{n} {s}" for s, n in counts.items() if n),
            "PASSED" if self.passed else "NOT PASSED",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------- notebook plumbing
def is_check_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def _read(path: Path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):  # same rule as tools/make_exercises.py for id-less files
        if not cell.get("id"):
            cell["id"] = f"cell-{i}"
    return nb


def find_solution(path: str | Path, solutions: str | Path | None = None) -> Path:
    """The pristine solution for an exercise file: same name in `solutions`, else in
    `solutions/` beside the exercise's folder, else in this repository's `solutions/`."""
    path = Path(path)
    if solutions is not None:
        candidates = [Path(solutions) / path.name]
    else:
        candidates = [path.resolve().parent.parent / "solutions" / path.name, REPO / "solutions" / path.name]
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise FileNotFoundError(
        f"no solution notebook for {path.name} (looked for {tried}); pass --solutions DIR"
    )


def assemble(learner, solution):
    """Learner's cells minus any check cell, plus the solution's check cells; outputs cleared."""
    canon = {c.id: c for c in solution.cells if is_check_cell(c)}
    cells, placed = [], set()
    for cell in learner.cells:
        if cell.get("id") in canon and cell.id not in placed:
            cells.append(copy.deepcopy(canon[cell.id]))  # the learner's copy sits here: use the original
            placed.add(cell.id)
        elif cell.get("id") in canon or is_check_cell(cell):
            continue  # duplicates and the learner's own "check" cells do not count
        else:
            cells.append(copy.deepcopy(cell))
    for idx, cell in enumerate(solution.cells):
        if cell.id not in canon or cell.id in placed:
            continue
        # Deleted by the learner: anchor after the nearest earlier solution cell still present,
        # or at the end (after all of the learner's code) if none is.
        ids = [c.get("id") for c in cells]
        pos = len(cells)
        for prev in reversed(solution.cells[:idx]):
            if prev.id in ids:
                pos = ids.index(prev.id) + 1
                break
        cells.insert(pos, copy.deepcopy(cell))
        placed.add(cell.id)
    for cell in cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if re.search(
                r"^from parallel_lab\.grading import .*\bgrade\b|\bgrade\(", cell.source, re.M
            ) and not is_check_cell(cell):
                # the learner's own "grade it here" cell: running it inside the grading run would nest kernels
                cell.metadata.setdefault("tags", []).append("skip-execution")
    nb = copy.deepcopy(learner)
    nb.cells = cells
    return nb, list(canon)


# ---------------------------------------------------------------------------- outcome of one cell
_RANK_ERROR = re.compile(r"rank \d+ raised (\w+): ?(.*)", re.S)


def classify_error(ename: str, evalue: str) -> tuple[str, str]:
    """(status, message) for an error output; a RankError is judged by the exception the rank raised."""
    inner = _RANK_ERROR.match(evalue) if ename == "RankError" else None
    kind = inner.group(1) if inner else ename
    if kind == "NotImplementedError":  # the stub's own message names the exercise and the hint
        message = inner.group(2) if inner else evalue
        return TODO, message.splitlines()[0] if message else kind
    if kind == "AssertionError":
        return FAIL, evalue or "AssertionError (no message)"
    if kind == "KeyboardInterrupt":  # what interrupt_on_timeout leaves behind
        return ERROR, "interrupted: the cell ran past the time limit (an endless loop or a hang?)"
    return ERROR, f"{ename}: {evalue}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL_FRAME = re.compile(r"^Cell In\[(\d+)\], line (\d+)(?:, in (\w+))?", re.M)  # IPython 9 adds the args
_FILE_FRAME = re.compile(r'File "[^"]*ipykernel_\d+[/\\]\d+\.py", line (\d+), in (\S+)\n\s+(\S.*)')


def learner_cells(nb) -> list[tuple[int, Any]]:
    """(1-based position, cell) of the learner's code cells: everything but the checks."""
    return [(i, c) for i, c in enumerate(nb.cells, 1) if c.cell_type == "code" and not is_check_cell(c)]


def cell_name(cell) -> str:
    """A cell as a learner finds it in JupyterLab: the number beside it after Restart Kernel and Run
    All Cells (the grading run's execution count) and its first line, e.g. 'cell [7] "def f(x):"'."""
    first = next((ln.strip() for ln in cell.source.splitlines() if ln.strip()), "")
    first = first if len(first) <= 72 else first[:69] + "..."
    count = cell.get("execution_count")
    return f'cell [{count if count is not None else " "}] "{first}"'


def signature(lines: list[str], func: str) -> str | None:
    """`func` as its `def` line in `lines` writes it, e.g. "ring_all_reduce(ctx, t, group=None)"
    (a method, "Class.method": the method's line); None when no such line (or it never closes)."""
    name = func.rsplit(".", 1)[-1]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(rf"\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", lines[i]):
            text, depth = "", 0
            for line in lines[i:]:  # a signature may span lines: read to the closing parenthesis
                for ch in line.strip():
                    text += ch
                    depth += ch == "("
                    depth -= ch == ")"
                    if depth == 0 and ch == ")":
                        args = text.split("(", 1)[1][:-1].rstrip(", ")
                        return f"{func}({' '.join(args.split())})"
                text += " "
            return None
    return None


def graded_functions(nb, check_cell) -> list[str]:
    """What a check cell grades, for the report: each name it passes that the learner's cells define,
    as 'ring_all_reduce(ctx, tensor, group=None), defined in cell [4] "def ring_all_reduce(..."'."""
    call = re.search(r"\bcheck_\w+\s*\((.*)\)", check_cell.source, re.S)
    names = re.findall(r"(?<![\w.=])([A-Za-z_]\w*)(?=\s*[,)])", call.group(1) + ")") if call else []
    out = []
    for name in dict.fromkeys(names):
        for _, cell in learner_cells(nb):
            lines = cell.source.splitlines()
            sig = signature(lines, name)
            if sig is None and any(re.match(rf"class\s+{name}\b", ln) for ln in lines):
                sig = f"class {name}"
            if sig is not None:
                out.append(f"{sig}, defined in {cell_name(cell)}")
                break
    return out


def where_in_cells(nb, traceback_lines: list[str], message: str) -> list[str]:
    """The frames of a failure that lie in the learner's own cells, innermost last, as
    'cell [4] "def ring_all_reduce(...)", line 12, in ring_all_reduce: chunks[k] += incoming'. Frames come from the kernel's
    traceback ("Cell In[7], line 12") and from a rank's traceback quoted in the message (a kernel
    cell's file and line; the cell is found by the line's text)."""
    mine = learner_cells(nb)
    by_count = {c.get("execution_count"): (i, c) for i, c in mine}
    out: list[str] = []

    def show(pos: int, cell, line: int, fn: str | None) -> None:
        lines = cell.source.splitlines()
        code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        entry = (
            f"{cell_name(cell)}, line {line}"
            + (f", in {fn}" if fn and fn != "<module>" else "")
            + f": {code}"
        )
        if entry not in out:
            out.append(entry)

    text = _ANSI.sub("", "\n".join(traceback_lines))
    for m in _CELL_FRAME.finditer(text):
        hit = by_count.get(int(m.group(1)))
        if hit is not None:
            show(hit[0], hit[1], int(m.group(2)), m.group(3))
    for m in _FILE_FRAME.finditer(message):
        line, fn, code = int(m.group(1)), m.group(2), m.group(3).strip()
        for pos, cell in mine:
            lines = cell.source.splitlines()
            if 0 < line <= len(lines) and lines[line - 1].strip() == code:
                show(pos, cell, line, fn)
                break
    return out


def _outcome(cell, cell_id: str, not_run: str, nb=None) -> CheckResult:
    found = re.search(r"\b(check_\w+)\s*\(", cell.source)
    name = found.group(1) if found else cell_id
    lines = [ln.strip() for ln in cell.source.splitlines() if ln.strip() and not ln.startswith("#")]
    call = next((ln for ln in lines if re.match(r"check_\w+\s*\(", ln)), lines[0] if lines else "")
    count = cell.get("execution_count")
    shown = f'cell [{count if count is not None else " "}] "{call}"'
    grades = graded_functions(nb, cell) if nb is not None else []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            status, message = classify_error(out.get("ename", ""), _ANSI.sub("", out.get("evalue", "")))
            # an unfinished exercise's frame is the stub's own raise: nothing to show
            where = (
                where_in_cells(nb, out.get("traceback", []), message)
                if nb is not None and status != TODO
                else []
            )
            # the rank's raw frames were only there to find the cells: the cells say it better
            message = message.split("\n\nyour code, on rank", 1)[0] if where else message
            return CheckResult(cell_id, name, status, message, where, shown, grades)
    if count is None:
        return CheckResult(cell_id, name, ERROR, f"not run: {not_run}", [], shown, grades)
    return CheckResult(cell_id, name, PASS, cell=shown, checks=grades)


def _kernel_manager_class():
    """A kernel manager that always starts ipykernel on this interpreter (sys.executable),
    whatever 'python3' kernelspec the machine has installed elsewhere."""
    import zmq
    from ipykernel.kernelspec import make_ipkernel_cmd
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager

    class ThisPythonKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            # Encrypt the kernel's sockets where this jupyter_client and libzmq can
            # (ipykernel otherwise warns on stderr about plain TCP).
            if "transport_encryption" in self.trait_names() and zmq.has("curve"):
                self.transport_encryption = "auto"

        @property
        def kernel_spec(self):
            if self._kernel_spec is None:
                self._kernel_spec = KernelSpec(
                    argv=make_ipkernel_cmd(executable=sys.executable),
                    display_name="Python 3",
                    language="python",
                    metadata={"supported_encryption": ["curve"]},
                )
            return self._kernel_spec

    return ThisPythonKernelManager


def execute(nb, cwd: str | Path, timeout: float = 300.0) -> str:
    """Run every cell of `nb` in place (errors recorded, not raised); returns why it stopped early, or ''."""
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        timeout=timeout,
        startup_timeout=120,  # importing torch in a fresh kernel on a busy laptop can be slow
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        allow_errors=True,
        interrupt_on_timeout=True,  # a hung check becomes a KeyboardInterrupt error and grading goes on
        resources={"metadata": {"path": str(cwd)}},
    )
    try:
        client.execute()
    except Exception as e:  # a dead kernel: report the cells that never ran, do not crash the grader
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return ""


def grade(path: str | Path, solutions: str | Path | None = None, timeout: float = 300.0) -> GradeReport:
    """Grade a learner's notebook against its solution's check cells (see the module docstring)."""
    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"path must be a Jupyter notebook (.ipynb), got {str(path)!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds per cell, got {timeout!r}")
    if not path.is_file():
        raise FileNotFoundError(f"notebook not found: {path}")
    solution_path = find_solution(path, solutions)
    try:
        learner = _read(path)
    except Exception as e:  # not JSON, or JSON that is not a notebook
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a Jupyter notebook ({reason[:120]})") from None
    solution = _read(solution_path)
    ours = {c.get("id") for c in solution.cells}
    shared = sum(c.get("id") in ours for c in learner.cells)
    if shared < max(1, len(solution.cells) // 2):
        raise ValueError(
            f"{path} is not the exercise notebook {solution_path.name}: only {shared} of its cells come from it "
            f"(grade exercises/{solution_path.name} or your copy of it; a lesson notebook has no exercises)"
        )
    nb, check_ids = assemble(learner, solution)
    if not check_ids:
        raise ValueError(
            f"{solution_path} has no check cells (code cells tagged {CHECK_TAG!r}); nothing to grade"
        )
    stopped = execute(nb, cwd=path.resolve().parent, timeout=timeout) or "an earlier cell stopped the run"
    by_id = {c.get("id"): c for c in nb.cells}
    report = GradeReport(path, solution_path)
    report.results = [_outcome(by_id[i], i, stopped, nb) for i in check_ids]
    return report


__all__ = [*CHECKS, "CHECKS", "CHECK_TAG", "ERROR", "FAIL", "PASS", "TODO", "CheckResult", "GradeReport",
           "assemble", "classify_error", "execute", "find_solution", "grade"]  # fmt: skip
