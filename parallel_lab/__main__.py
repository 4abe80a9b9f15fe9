"""`python -m parallel_lab` (or `parallel-lab`): doctor, lessons, grade, exercises."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor(args: argparse.Namespace) -> int:
    """What launch() will use here, and whether the notebook tooling is in place."""
    import torch

    from parallel_lab.runtime import device as mesh

    gpus = mesh.gpu_names()
    backend, why = mesh.auto_backend(1)  # what launch(backend="auto") picks for a world that fits the GPUs
    backend += (
        f" (one GPU per rank, up to {len(gpus)} ranks; gloo beyond)" if backend == "nccl" else f" ({why})"
    )
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("backend", backend),
        ("cpu cores", str(mesh.cpu_cores())),
        ("gpus", f"{len(gpus)}" + (": " + ", ".join(gpus) if gpus else "")),
        (
            "cuda",
            f"{torch.version.cuda} (this torch build)"
            if torch.version.cuda
            else "none (a CPU build of torch)",
        ),
        ("nccl", _nccl()),
        ("gloo", "available" if torch.distributed.is_gloo_available() else "not available"),
        ("jupyterlab", _version("jupyterlab")),
        ("ipywidgets", _version("ipywidgets")),
        ("jupyterlab_widgets", _version("jupyterlab_widgets") + " (renders widgets in JupyterLab)"),
        ("accelerate", _version("accelerate")),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    plan = lesson_backends(len(gpus))
    if plan:
        print(
            "\nlessons (the rank counts read from their cells' launch calls -> the backend each gets here):"
        )
        for name, sizes, chosen in plan:
            print(f"  {name:<26} {'/'.join(map(str, sizes)):>8} rank{'s' * (sizes != (1,))}  {chosen}")
    missing = [k for k, v in rows if v.startswith("not installed")]
    if missing:
        print(f"\nmissing: {', '.join(missing)} -> pip install -e '.[lab]'")
    return 0


def _nccl() -> str:
    import torch

    if not torch.distributed.is_nccl_available():
        return "not available (no CUDA in this torch build: gloo on CPU)"
    try:
        v = torch.cuda.nccl.version()  # reads the linked library's version; creates no CUDA context
    except Exception as e:  # noqa: BLE001 - report, do not fail the doctor
        return f"available (version unknown: {e})"
    return "available, version " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))


_LAUNCH = re.compile(r"\blaunch(?:_learner)?\(\s*[\w.]+\s*,\s*(?:world_size\s*=\s*)?(\d+|[A-Za-z_]\w*)")


def _call_text(code: str, start: int) -> str:
    """The text of the call that opens at the first "(" after `start`, up to its closing ")"."""
    i = code.index("(", start)
    depth = 0
    for j in range(i, len(code)):
        depth += {"(": 1, ")": -1}.get(code[j], 0)
        if depth == 0:
            return code[start : j + 1]
    return code[start:]


def _launch_sizes(cells: list[str]) -> dict[int, set[str]]:
    """Rank count -> the backends its launches name ("auto" where a call names none), for the rank
    counts a notebook's code cells launch: a number written in the call, or a name bound to a
    number at a cell's top level (`N = 4`) or looped over numbers in the launching cell (`for p in
    (2, 3)`). A name bound otherwise (a slider's value, a tuple unpacked) is not read."""
    code = "\n".join(cells)
    sizes: dict[int, set[str]] = {}
    for cell in cells:
        for m in _LAUNCH.finditer(cell):
            arg = m.group(1)
            named = re.search(r"\bbackend\s*=\s*[\"'](\w+)[\"']", _call_text(cell, m.start()))
            backend = named.group(1) if named else "auto"
            if arg.isdigit():
                found = {int(arg)}
            else:
                name = re.escape(arg)
                found = {int(n) for n in re.findall(rf"^{name}\s*=\s*(\d+)\s*(?:#.*)?$", code, re.M)}
                for group in re.findall(rf"\bfor\s+{name}\s+in\s+[(\[]([\d,\s]+)[)\]]", cell):
                    found.update(int(n) for n in re.findall(r"\d+", group))
            for n in found:
                sizes.setdefault(n, set()).add(backend)
    return sizes


def lesson_backends(gpus: int, folder: Path | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(lesson, the rank counts its cells launch, the backend each gets) for each lesson notebook,
    by the rule `launch(backend="auto")` follows (`device.backend_rule`): NCCL for a launch whose
    every rank can have its own GPU, gloo for the others, all gloo under ACCELERATE_USE_CPU."""
    from parallel_lab.runtime import device as mesh

    folder = folder or REPO / "notebooks"
    out = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        code = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"]
        named = _launch_sizes(code)
        sizes = tuple(sorted(named))
        if not sizes:
            continue
        picks = {  # a launch that names its backend gets it; "auto" follows the rule
            n: "gloo (set in the lesson)" if named[n] == {"gloo"} else mesh.backend_rule(n, gpus, True, mesh.wants_cpu())[0]
            for n in sizes
        }  # fmt: skip
        if len(set(picks.values())) == 1:
            b = next(iter(picks.values()))
            chosen = "nccl (one GPU per rank)" if b == "nccl" else b if b.startswith("gloo (set") else (
                "gloo" + (f" (needs {max(sizes)} GPUs for nccl)" if gpus and not mesh.wants_cpu() else " (CPU)"))  # fmt: skip
        else:
            chosen = "; ".join(f"{n} rank{'s' * (n > 1)}: {b}" for n, b in picks.items())
        out.append((path.stem, sizes, chosen))
    return out


def _title(path: Path) -> str:
    """First markdown heading of a notebook."""
    for cell in json.loads(path.read_text(encoding="utf-8")).get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "(untitled)"


def lessons(args: argparse.Namespace) -> int:
    """Lessons in notebooks/ with their titles and exercise notebooks."""
    folder = args.root / "notebooks"
    books = sorted(folder.glob("*.ipynb"))
    if not books:
        print(f"no lessons found in {folder}")
        return 1
    for book in books:
        prefix = book.name.split("_", 1)[0]
        ex = sorted((args.root / "exercises").glob(f"{prefix}_*.ipynb"))
        extra = f"  [exercises: {', '.join('exercises/' + e.name for e in ex)}]" if ex else ""
        print(f"notebooks/{book.name:<28} {_title(book)}{extra}")
    return 0


def grade(args: argparse.Namespace) -> int:
    """Grade each notebook; exit 0 only when every check of every notebook passes."""
    from parallel_lab.grading import grade as grade_notebook

    ok = True
    for path in args.paths:
        try:
            report = grade_notebook(path, solutions=args.solutions, timeout=args.timeout)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(report.summary() + "\n")
        ok &= report.passed
    return 0 if ok else 1


def exercises(args: argparse.Namespace) -> int:
    """Run tools/make_exercises.py of this checkout (teachers' tool; not part of an installed package)."""
    tool = args.root / "tools" / "make_exercises.py"
    if not tool.is_file():
        print(f"error: {tool} not found (this command needs a checkout of the repository)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("make_exercises", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    defaults = ["--solutions", str(args.root / "solutions"), "--exercises", str(args.root / "exercises")]
    return module.main(defaults + args.rest)  # argparse keeps the last value: the caller's options win


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab", description=__doc__)
    parser.add_argument("--root", type=Path, default=REPO, help="repository root (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="torch, backend, cores, GPUs, JupyterLab/widgets/accelerate").set_defaults(
        run=doctor
    )
    sub.add_parser("lessons", help="list the lesson notebooks").set_defaults(run=lessons)
    g = sub.add_parser("grade", help="grade exercise notebooks against their solutions' checks")
    g.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="exercise notebook(s)")
    g.add_argument("--solutions", type=Path, default=None, help="folder with the solution notebooks")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per cell (default: %(default)s)")
    g.set_defaults(run=grade)
    # Its options (--check, --help, ...) belong to tools/make_exercises.py and pass through.
    sub.add_parser(
        "exercises", add_help=False, help="regenerate exercises/ from solutions/ (--check: verify only)"
    ).set_defaults(run=exercises)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "exercises":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
