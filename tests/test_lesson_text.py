"""The lab speaks in its own words: no Chinese text and no references to source notes in what a
learner reads (lessons, exercises, solutions, README, package docstrings and script output)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
NOTES = re.compile(r"\bseeds?\s+0\d\d\b|\bseed notes?\b|\bthe seeds?'s?\b|\bseeds: ", re.IGNORECASE)

NOTEBOOKS = sorted(
    str(p.relative_to(REPO))
    for d in ("notebooks", "exercises", "solutions")
    for p in (REPO / d).glob("*.ipynb")
)
TEXTS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "parallel_lab").rglob("*.py"))]


def _offences(text: str) -> list[str]:
    bad = [line.strip()[:120] for line in text.splitlines() if CJK.search(line) or NOTES.search(line)]
    # a reference broken across two lines ("seed\n000") is one too
    return bad or [m.group(0).replace("\n", " ") for m in NOTES.finditer(text)]


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_text_is_the_labs_own(path):
    nb = nbformat.read(REPO / path, as_version=4)
    bad = []
    for i, cell in enumerate(nb.cells):
        outputs = [
            o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])
        ]
        for text in [cell.source, *("".join(t) if isinstance(t, list) else t for t in outputs)]:
            bad += [f"cell {i}: {line}" for line in _offences(text)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", TEXTS)
def test_package_and_readme_text_is_the_labs_own(path):
    bad = _offences((REPO / path).read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


def test_the_patterns_catch_what_they_are_for():
    assert _offences("Seed 000: the parameter server") and _offences("as the seed's figure shows")
    assert _offences("数据并行") and _offences("Seeds: 000 (ZeRO)") and _offences("see seed\n000 for it")
    assert not _offences("torch.manual_seed(0); seed=3; build_model(cfg, seed)")
