"""The benchmarks run end to end at toy sizes and leave rows the summary can read.

Timings are not asserted (tests check correctness, not speed): what is checked is that every
benchmark writes ratios the one summary table reads, each ours / theirs with a goal or none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

TOY = {
    "collectives": ["--sizes", "0.25", "--ranks", "2", "--repeats", "1"],
    "fingerprint": ["--ranks", "2", "--repeats", "1"],
    "ddp": ["--ranks", "2", "--rounds", "1", "--d-model", "32", "--layers", "1", "--batch", "4"],
    "zero": ["--ranks", "2", "--rounds", "1", "--d-model", "32", "--layers", "2"],
    "tensor_parallel": ["--hidden", "32", "--ranks", "2", "--repeats", "1"],
    "memory_overhead": ["--quick"],
    "launch": ["--ranks", "2", "--repeats", "1", "--torchrun-repeats", "1"],
    "checkpoint": ["--sizes", "0.05", "--rounds", "1"],
    "comm_hooks": ["--ranks", "2", "--d-model", "32", "--layers", "1", "--rounds", "1"],
}


def _run(script: str, args: list[str], results: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARALLEL_LAB_BENCH_RESULTS": str(results)}
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)  # fmt: skip


@pytest.mark.slow
def test_every_benchmark_feeds_the_summary(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # two at a time: each mostly waits on its own ranks' start-up (timings are not checked here)
    with ThreadPoolExecutor(2) as pool:
        outs = dict(zip(TOY, pool.map(lambda kv: _run(kv[0], kv[1], tmp_path), TOY.items())))
    for name, out in outs.items():
        assert out.returncode == 0, f"{name}: {out.stderr[-2000:]}"
        assert "lower is better" in out.stdout, f"{name} must say which way its ratios go:\n{out.stdout}"
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        assert rows and all(r["ratio"] > 0 and (r["goal"] is None or r["goal"] > 0) for r in rows), rows
    out = _run("summary", [], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ours / theirs" in out.stdout and "lower is better" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {r["bench"] for r in summary} == set(TOY)
    for r in summary:  # met is exactly "ratio at or below the goal", None when not gated
        assert r["met"] == (None if r["goal"] is None else r["ratio"] <= r["goal"]), r


def test_summary_without_results_says_what_to_run(tmp_path):
    out = _run("summary", [], tmp_path / "empty")
    assert out.returncode == 1 and "run the benchmarks first" in out.stderr


def test_a_row_without_its_fields_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PARALLEL_LAB_BENCH_RESULTS", str(tmp_path))
    import importlib

    import _results

    importlib.reload(_results)
    with pytest.raises(ValueError, match="rows need exactly measure, ratio and goal"):
        _results.record("x", [{"measure": "m", "ratio": 1.0}])
    assert _results.record("x", [{"measure": "m", "ratio": 0.5, "goal": 1.0}]).parent == tmp_path
