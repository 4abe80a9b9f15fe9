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


def table_cheat_fails(lesson: str, name: str, check: str, missing, match: str = "", key=None, tries: int = 1):
    """A learner who logs what the reference answers in one grade run, keyed by the arguments, and answers
    from that table in the next (`missing` where it has nothing) fails a later run, with `match` in the
    message. `key(*args)` makes the arguments hashable (default: the arguments themselves). `tries` > 1 where
    a run draws from a small set and may, rarely, repeat a case the table holds."""
    import pytest

    key = key or (lambda *args, **kwargs: (args, tuple(sorted(kwargs.items()))))
    ns = solution_namespace(lesson)
    real, table = ns[name], {}

    def logging(*args, **kwargs):
        table[key(*args, **kwargs)] = out = real(*args, **kwargs)
        return out

    cell = compile(_check_cell(lesson, check), f"<check cell {check}>", "exec")
    ns[name] = logging
    exec(cell, ns)  # noqa: S102
    assert table, f"{check} never called {name}"
    ns[name] = lambda *args, **kwargs: table.get(key(*args, **kwargs), missing)
    for _ in range(tries):
        try:
            exec(cell, ns)  # noqa: S102
        except AssertionError as e:
            assert match in str(e), e
            return
    pytest.fail(f"{tries} grade run(s) in a row drew only cases one earlier run's table held")


@functools.cache
def package_sources(package: str = "torch") -> tuple[tuple[str, str], ...]:
    """(dotted module, source text) of every .py file of an installed package, read once per test process:
    the tests that search torch for its own versions of an exercise share one read (about 46 MB)."""
    import importlib.util

    root = Path(importlib.util.find_spec(package).origin).parent
    return tuple(
        (".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"),
         f.read_text(encoding="utf-8", errors="ignore"))
        for f in sorted(root.rglob("*.py"))
    )  # fmt: skip


def functions_doing(job, package: str = "torch", skip=("testing", "test")) -> dict[str, list[str]]:
    """{module: names} of the definitions `job` (a compiled regex whose group 1 is the name) finds in a
    package, leaving out test code: modules with a part named in `skip`, or whose last part starts with "test"."""
    found: dict[str, list[str]] = {}
    for module, text in package_sources(package):
        parts = module.split(".")
        if any(p in skip for p in parts) or parts[-1].startswith("test"):
            continue
        names = [m.group(1) for m in job.finditer(text)]
        if names:
            found.setdefault(module, []).extend(names)
    return found


def not_switched_off(found: dict[str, list[str]], off: dict[str, str]) -> dict[str, list[str]]:
    """The names of `found` (module -> names) that no key of `off` (dotted targets) switches off."""
    missing = {m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
               for m, names in found.items()}  # fmt: skip
    return {m: names for m, names in missing.items() if names}


def passes_with_one_line(lesson: str, check: str, capsys) -> None:
    """The reference solution passes `check`, printing exactly one line (`check passed...`) and nothing on stderr."""
    run_check(lesson, check)
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("check_")]
    assert lines == [lines[0]] and lines[0].startswith(f"{check} passed") and not err, (out, err)


def fails_saying(lesson: str, check: str, label: str, source: str, want: str) -> str:
    """The learner's cell `source` fails `check` with `want` in the message; returns the message."""
    import pytest

    with pytest.raises(AssertionError) as info:
        run_check(lesson, check, source)
    assert want in str(info.value), f"{label}: {info.value}"
    return str(info.value)
