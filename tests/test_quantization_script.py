"""Lesson 12's script: data-parallel int8 inference under torchrun, accelerate launch and `launch`.

The launcher runs are real multi-process jobs (every rank imports torch): marked slow. Each checks
the script's own verdict against single-process inference, the error ordering the lesson teaches
(one scale per tensor > vector-wise > LLM.int8 decomposition on the planted outliers), and the trace.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import parallel_lab as pl
from parallel_lab import RunResult, comms
from parallel_lab.scripts import quantization as script

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OK_LINE = "matches single-process quantized inference"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _errors(stdout: str) -> dict[str, float]:
    """The distributed relative error of each table row."""
    return {
        m[1]: float(m[2]) for m in re.finditer(r"^(absmax|vectorwise|llm_int8)\s+([0-9.]+)", stdout, re.M)
    }


def _check_run(out: subprocess.CompletedProcess, trace: Path) -> None:
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert OK_LINE in out.stdout, out.stdout
    err = _errors(out.stdout)
    assert err["llm_int8"] < err["vectorwise"] < err["absmax"], out.stdout
    assert "4.00x" in out.stdout  # int8 weights are a quarter of fp32
    res = RunResult.load(str(trace))
    assert res.world_size == 2
    assert {e["rank"] for e in res.timeline} == {0, 1}
    assert {"fp32 forward", "llm_int8 forward", "all_reduce"} <= {e["name"] for e in res.timeline}
    # one all-reduce of 4 float32 (3 squared errors and the fp32 norm): the ring's exact bytes
    want = comms.ring_bytes_per_rank(4, 2, 4, "all_reduce")
    got = [(c["by_op"]["all_reduce"]["sent"], c["by_op"]["all_reduce"]["recv"]) for c in res.comm_bytes]
    assert got == want and all(s > 0 for s, _ in got), res.comm_bytes


@pytest.mark.slow
def test_script_under_torchrun(tmp_path):
    trace = tmp_path / "trace.json"
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "parallel_lab.scripts.quantization",
           "--trace", str(trace)]  # fmt: skip
    _check_run(_run(cmd), trace)


@pytest.mark.slow
def test_script_under_accelerate_launch(tmp_path):
    trace = tmp_path / "trace.json"
    cfg = REPO / "parallel_lab" / "configs" / "accelerate_cpu.yaml"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(cfg), "--num_processes", "2", "-m",
           "parallel_lab.scripts.quantization", "--trace", str(trace)]  # fmt: skip
    _check_run(_run(cmd), trace)


def test_rank_function_in_process():
    # 3 ranks on 7 rows: uneven slices (3/2/2); the all-reduced errors are the whole batch's
    res = pl.launch(script.run_quantized_inference, 3, batch=7)
    assert [v["rows"] for v in res.values] == [3, 2, 2]
    v0 = res.values[0]
    for s in script.METHODS:
        assert v0["errors"][s] == pytest.approx(v0["reference"][s], rel=script.TOL)
        assert all(v["errors"][s] == v0["errors"][s] for v in res.values)
    # per-token scales: cutting the batch changes nothing; a per-tensor scale depends on the rows it sees
    assert v0["errors"]["vectorwise"] == pytest.approx(v0["one_forward"]["vectorwise"], rel=script.TOL)
    assert v0["errors"]["absmax"] != pytest.approx(v0["one_forward"]["absmax"], rel=1e-3)
    assert all(w8 * 4 == v0["fp32_bytes"] for w8, _ in v0["bytes"].values())
    _, ok = script.report(res.values)
    assert ok


def test_main_without_launcher(tmp_path, capsys):
    trace = tmp_path / "q.json"
    assert script.main(["--nproc", "2", "--schemes", "vectorwise", "llm_int8", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert OK_LINE in out and "absmax" not in out
    assert RunResult.load(str(trace)).world_size == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--schemes", "int4"], "argument --schemes: invalid choice: 'int4'"),
        (["--batch", "1", "--nproc", "2"], r"--batch \(1\) must be at least the number of ranks \(2\)"),
        (["--magnitude", "0"], "--magnitude must be > 0"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_rank_function_bad_input():
    with pytest.raises(pl.RankError, match=r"batch \(1\) must be at least the number of ranks \(2\)"):
        pl.launch(script.run_quantized_inference, 2, batch=1)
    with pytest.raises(pl.RankError, match="schemes must be a non-empty subset"):
        pl.launch(script.run_quantized_inference, 1, schemes=("int4",))
