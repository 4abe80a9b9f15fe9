"""The package's shape: one folder per family, no import cycles, dependencies pointing one way.

Every `import` in every module counts, the ones inside functions too: a deferred import is
still a dependency a reader must follow. Importing `parallel_lab.a.b` also runs the package
`parallel_lab.a`'s `__init__`, so that is an edge as well (except into the importer's own
parent packages, which Python has already started).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "parallel_lab"

#: The order of the layers: a family may import its own layer and the layers before it.
#: runtime <- comms <- techniques <- lessons; plots read the runtime's records.
LAYERS = [
    {"runtime"},
    {"plots", "models"},
    {"comms"},
    {"costmodel"},
    {"data_parallel", "precision", "checkpointing", "tensor_parallel", "moe", "quantization", "compression"},
    {"zero", "pipeline"},
    {"offload", "three_d", "resilience", "inference", "context_parallel"},
    {"grading", "scripts"},
    {"__main__", "__init__"},
]
#: Upward edges that are part of the public API, each with its reason.
ALLOWED_UP = {
    # RunResult.plot_timeline() and launch(live=True) draw with plots, which only reads runtime records.
    ("runtime", "plots"),
    # measuring model state runs one real step of a lab model (memory_state.measure_model_state).
    ("runtime", "models"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            if not t.startswith("parallel_lab"):
                continue
            parts = t.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in modules and not name.startswith(target + ".") and target != name:
                    if target == "parallel_lab" and k < len(parts):
                        continue  # `import parallel_lab.x` is a dependency on x, not on the top-level door
                    found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _family(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_dependencies_point_one_way():
    layer = {fam: i for i, fams in enumerate(LAYERS) for fam in fams}
    wrong = []
    for m, targets in _graph().items():
        for t in targets:
            a, b = _family(m), _family(t)
            if a == b or (a, b) in ALLOWED_UP:
                continue
            assert a in layer and b in layer, f"family {a if a not in layer else b} has no layer in LAYERS"
            if layer[b] > layer[a]:
                wrong.append(f"{m} -> {t}")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(sorted(wrong))


def test_other_families_use_public_names_only():
    """Outside its family, a module imports a family's package or its public (non-underscore) names."""
    modules = _modules()
    wrong = []
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallel_lab."):
                if _family(node.module) != _family(m):
                    wrong += [
                        f"{m}: from {node.module} import {a.name}"
                        for a in node.names
                        if a.name.startswith("_")
                    ]
    assert not wrong, "\n".join(wrong)


# scripts/ is one entry per technique (no reading order); every other folder is a family.
@pytest.mark.parametrize(
    "family", sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file() and p.name != "scripts")
)
def test_each_family_says_what_it_teaches_and_the_reading_order(family):
    doc = ast.get_docstring(ast.parse((PKG / family / "__init__.py").read_text())) or ""
    files = sorted(f.name for f in (PKG / family).glob("*.py") if f.name != "__init__.py")
    missing = [f for f in files if f not in doc]
    assert len(doc) > 200 and not missing, (
        f"{family}/__init__.py docstring lacks the reading order of {missing}"
    )


def test_top_level_holds_only_the_door_the_cli_and_the_models():
    top = sorted(f.name for f in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "models.py"], top


def test_other_families_are_reached_through_their_package():
    """`from parallel_lab.zero import X`, not `from parallel_lab.zero.layout import X`: a family's
    `__init__` is its public face. The runtime's `__init__` imports nothing (so reading a record
    module does not start the launcher): its modules are imported by name."""
    wrong = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallel_lab."):
                parts = node.module.split(".")
                if len(parts) > 2 and parts[1] != "runtime" and _family(node.module) != _family(m):
                    wrong.append(f"{m}: from {node.module} import ...")
    assert not wrong, "\n".join(wrong)
