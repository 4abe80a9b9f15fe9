"""Lesson scripts under the two launchers people use: torchrun and accelerate launch.

Each run is a real multi-process job (every rank imports torch), so this file keeps one run per
script and launcher that other test files do not already cover: ddp, zero --offload, zero --replicate (HSDP), pipeline,
three_d, moe, moe_at_scale (3 nodes x 2), inference (pp), compression, long_sequences (ring, 2 x 2) and fewer_bytes (PowerSGD) under torchrun; ddp, zero (stage 1; HSDP), pipeline, tensor_parallel, three_d (8 ranks),
mixed_precision, moe_at_scale (2 nodes x 2), inference (tp), long_sequences (ulysses) and fewer_bytes (top-k, 3 ranks) under
accelerate launch with the shipped CPU config. Each script checks its own result against
single-process training and says so on stdout; the trace it writes must load.
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
        "parallel_lab.scripts.three_d --dp 1 --tp 2 --pp 2 --steps 2 --no-memory".split(),
        "matches single-process training",
        set(),
    ),
    "zero-offload": (
        2,
        ["parallel_lab.scripts.zero", "--offload", "--steps", "2", "--d-model", "32", "--layers", "2"],
        "identical weights on every rank; bytes equal the formulas",
        {"host Adam", "D2H grads"},
    ),
    "zero-hsdp": (  # lesson 20: 2 replicas x 2 shards, bytes on both axes against the formula
        4,
        "parallel_lab.scripts.zero --stage 3 --replicate 2 --steps 2 --d-model 32 --layers 2".split(),
        "identical weights on every rank; bytes equal the formulas",
        set(),
    ),
    "compression": (
        2,
        ["parallel_lab.scripts.compression", "--steps", "60", "--teacher-steps", "150"],
        "compression table complete",
        {"control", "4-bit qat"},
    ),
    "inference-pp": (
        2,
        ["parallel_lab.scripts.inference", "--mode", "pp", "--microbatches", "2"],
        "tokens match the single-process model",
        {"prefill mb0", "decode mb1"},
    ),
    "long_sequences-ring": (
        4,
        ["parallel_lab.scripts.long_sequences", "--dp", "2", "--steps", "2"],
        "matches single-process training",
        {"ring attention", "isendrecv"},
    ),
    "fewer_bytes-powersgd": (
        2,
        ["parallel_lab.scripts.fewer_bytes", "--hook", "powersgd", "--steps", "3"],
        "every rank holds the same weights",
        {"hook step", "ring_all_reduce"},
    ),
    "moe-expert-parallel": (
        4,
        ["parallel_lab.scripts.moe", "--steps", "1", "--tokens", "16"],
        "expert parallel matches the single-process layer",
        {"moe_dispatch", "moe_combine"},
    ),
    "moe_at_scale-3-nodes": (  # lesson 21 on 6 ranks as 3 nodes: hop 1 has two other nodes to reach
        6,
        "parallel_lab.scripts.moe_at_scale --nodes 3 --tokens 12 --max-groups 0".split(),
        "MoE at scale matches the single-process layer",
        {"moe_dispatch_inter", "moe_dispatch_intra"},
    ),
}

ACCELERATE_CASES = {
    # id: (processes, script args, line the script prints when it matches its reference)
    "ddp-ring": (
        2,
        ["parallel_lab.scripts.ddp", "--variant", "ddp", "--comm", "ring", "--steps", "2"],
        "identical weights on every rank: True",
    ),
    "zero-stage1-mixed": (
        2,
        "parallel_lab.scripts.zero --stage 1 --precision mixed --steps 2 --d-model 32 --layers 2".split(),
        "identical weights on every rank; bytes equal the formulas",
    ),
    "zero-hsdp-mixed": (  # lesson 20: HSDP, 2 replicas x 2 shards, 16-bit gathers and gradients
        4,
        "parallel_lab.scripts.zero --stage 3 --replicate 2 --precision mixed --steps 2 --d-model 32 --layers 2".split(),
        "identical weights on every rank; bytes equal the formulas",
    ),
    "tensor_parallel-sp": (
        2,
        ["parallel_lab.scripts.tensor_parallel", "--sequence-parallel", "--seq", "8", "--d-model", "32"],
        "matches the single-process model",
    ),
    "three_d-2x2x2": (
        8,
        "parallel_lab.scripts.three_d --dp 2 --tp 2 --pp 2 --steps 2 --no-memory".split(),
        "matches single-process training",
    ),
    "mixed_precision-overflow": (
        2,
        ["parallel_lab.scripts.mixed_precision", "--steps", "4", "--overflow-at", "2"],
        "same scale: True; identical weights: True",
    ),
    "inference-tp": (
        2,
        ["parallel_lab.scripts.inference", "--mode", "tp"],
        "tokens match the single-process model",
    ),
    "long_sequences-ulysses": (
        2,
        ["parallel_lab.scripts.long_sequences", "--method", "ulysses", "--steps", "2"],
        "matches single-process training",
    ),
    "fewer_bytes-topk": (
        3,
        ["parallel_lab.scripts.fewer_bytes", "--hook", "topk", "--steps", "3"],
        "bytes equal the formula",
    ),
    "moe_at_scale": (  # lesson 21: two-hop node-limited dispatch and EPLB serving, 2 nodes x 2
        4,
        ["parallel_lab.scripts.moe_at_scale", "--tokens", "16"],
        "MoE at scale matches the single-process layer",
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


def _accelerate(ranks: int, args: list[str], trace: Path) -> subprocess.CompletedProcess:
    cfg = REPO / "parallel_lab" / "configs" / "accelerate_cpu.yaml"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(cfg), "--num_processes", str(ranks), "-m",
           *args, "--trace", str(trace)]  # fmt: skip
    return _run(cmd)


@pytest.mark.slow
def test_pipeline_under_accelerate_launch(tmp_path):
    """A zero-bubble schedule (lesson 19; lesson 09's 1F1B runs without a launcher in its notebook)."""
    trace = tmp_path / "trace.json"
    out = _accelerate(2, ["parallel_lab.scripts.pipeline", "--schedule", "zb-h2", "--steps", "2"], trace)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "losses match single-process training" in out.stdout
    assert RunResult.load(str(trace)).world_size == 2


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ACCELERATE_CASES))
def test_script_under_accelerate_launch(case, tmp_path):
    ranks, args, ok_line = ACCELERATE_CASES[case]
    trace = tmp_path / "trace.json"
    out = _accelerate(ranks, args, trace)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert ok_line in out.stdout, out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == ranks and res.backend == "gloo"
    assert {e["rank"] for e in res.timeline} == set(range(ranks))
    assert res.comm_bytes, "no communication was counted"
