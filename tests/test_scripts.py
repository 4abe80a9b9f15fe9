"""Lesson scripts under the two launchers people use: torchrun and accelerate launch.

Each run is a real multi-process job (every rank imports torch), so this file keeps one run per
script that other test files do not already cover: ddp, pipeline and three_d under torchrun, and
one accelerate launch of a training script with the shipped CPU config. Each script checks its own
result against single-process training and says so on stdout; the trace it writes must load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lab import RunResult

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


CASES = {
    # id: (ranks, script args, line the script prints when it matches its reference, span names)
    "ddp-accumulation": (
        2,
        ["parallel_lab.scripts.ddp", "--variant", "ddp", "--accumulation", "2", "--steps", "2"],
        "identical weights on every rank: True",
        {"bucket", "bwd"},
    ),
    "pipeline-interleaved": (
        4,
        ["parallel_lab.scripts.pipeline", "--schedule", "interleaved", "--steps", "2"],
        "losses match single-process training",
        set(),
    ),
    "three_d-1x2x2": (
        4,
        [
            "parallel_lab.scripts.three_d",
            "--dp",
            "1",
            "--tp",
            "2",
            "--pp",
            "2",
            "--steps",
            "2",
            "--no-memory",
        ],
        "matches single-process training",
        set(),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_script_under_torchrun(case, tmp_path):
    ranks, args, ok_line, spans = CASES[case]
    trace = tmp_path / "trace.json"
    out = _run([str(BIN / "torchrun"), "--nproc-per-node", str(ranks), "-m", *args, "--trace", str(trace)])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert ok_line in out.stdout, out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == ranks
    assert {e["rank"] for e in res.timeline} == set(range(ranks))
    names = {e["name"] for e in res.timeline}
    assert all(any(s in n for n in names) for s in spans), sorted(names)
    assert res.comm_bytes, "no communication was counted"


@pytest.mark.slow
def test_pipeline_under_accelerate_launch(tmp_path):
    trace = tmp_path / "trace.json"
    cfg = REPO / "parallel_lab" / "configs" / "accelerate_cpu.yaml"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(cfg), "--num_processes", "2", "-m",
           "parallel_lab.scripts.pipeline", "--schedule", "1f1b", "--steps", "2", "--trace", str(trace)]  # fmt: skip
    out = _run(cmd)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "losses match single-process training" in out.stdout
    assert RunResult.load(str(trace)).world_size == 2
