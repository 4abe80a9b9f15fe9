"""Every family on real GPUs (NCCL, one GPU per rank): `pytest -m gpu` on a machine that has them.

Each run is checked against single-process training by the script itself (the line it prints),
is on NCCL, and its timeline's communication spans have a length (a span that ended when the
op was queued would be ~0 s: comm spans are timed with CUDA events). The exercise checks run
through the grade command on the solutions. Without two GPUs these tests are skipped; the checks
one GPU can make (world size 1 on NCCL, device clocks, the allocator, pinned copies, fp8 GEMMs,
more ranks than GPUs) are tests/test_gpu_one.py, run by `make gpu-check`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parallel_lab import RunResult
from parallel_lab.runtime import device as dev

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPUS = dev.gpu_count()  # counted without creating a CUDA context in this process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for NCCL and -m gpu, {GPUS} visible"),
]

FAMILIES = {
    # id: (ranks, script args, the line the script prints when it matches its reference)
    "collectives": (2, ["parallel_lab.scripts.collectives"], "all collectives match torch.distributed"),
    "ddp": (2, ["parallel_lab.scripts.ddp", "--variant", "ddp", "--steps", "2"], "identical weights on every rank: True"),
    "ddp-ring": (2, ["parallel_lab.scripts.ddp", "--variant", "ddp", "--comm", "ring", "--steps", "2"],
                 "identical weights on every rank: True"),
    "zero1": (2, "parallel_lab.scripts.zero --stage 1 --steps 2".split(), "identical weights on every rank"),
    "zero2": (2, "parallel_lab.scripts.zero --stage 2 --steps 2".split(), "identical weights on every rank"),
    "zero3": (2, "parallel_lab.scripts.zero --stage 3 --steps 2".split(), "identical weights on every rank"),
    "offload": (2, "parallel_lab.scripts.zero --offload --steps 2".split(), "identical weights on every rank"),
    "tensor_parallel": (2, ["parallel_lab.scripts.tensor_parallel"], "matches the single-process model"),
    "sequence_parallel": (2, ["parallel_lab.scripts.tensor_parallel", "--sequence-parallel"],
                          "matches the single-process model"),
    "gpipe": (2, "parallel_lab.scripts.pipeline --schedule gpipe --steps 2".split(), "losses match"),
    "1f1b": (2, "parallel_lab.scripts.pipeline --schedule 1f1b --steps 2".split(), "losses match"),
    "interleaved": (2, "parallel_lab.scripts.pipeline --schedule interleaved --steps 2".split(), "losses match"),
    "moe": (2, ["parallel_lab.scripts.moe", "--steps", "1"], "expert parallel matches the single-process layer"),
    "moe_at_scale": (2, ["parallel_lab.scripts.moe_at_scale"], "MoE at scale matches the single-process layer"),
    "inference-tp": (2, ["parallel_lab.scripts.inference", "--mode", "tp"], "tokens match the single-process model"),
    "inference-pp": (2, ["parallel_lab.scripts.inference", "--mode", "pp"], "tokens match the single-process model"),
    "long_sequences": (2, ["parallel_lab.scripts.long_sequences"], "matches single-process training"),
    "fewer_bytes": (2, ["parallel_lab.scripts.fewer_bytes", "--steps", "3"], "every rank holds the same weights"),
    "compression": (2, ["parallel_lab.scripts.compression", "--steps", "60", "--teacher-steps", "150"],
                    "compression table complete"),
    "mixed_precision": (2, ["parallel_lab.scripts.mixed_precision", "--steps", "4", "--overflow-at", "2"],
                        "identical weights: True"),
    "quantization": (2, ["parallel_lab.scripts.quantization"], "matches single-process quantized inference"),
}  # fmt: skip


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_on_nccl(family, tmp_path):
    ranks, args, ok = FAMILIES[family]
    trace = tmp_path / "trace.json"
    out = _run([str(BIN / "torchrun"), "--nproc-per-node", str(ranks), "-m", *args, "--trace", str(trace)])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert ok in out.stdout, out.stdout
    res = RunResult.load(str(trace))
    assert res.backend == "nccl"
    comm = [e for e in res.timeline if e["kind"] == "comm"]
    assert comm and all(e["args"].get("clock") == "cuda_event" for e in comm)
    assert sum(e["end"] - e["start"] for e in comm) > 0
    _cross_check_memory(res)


def _cross_check_memory(res: RunResult) -> None:
    """Every memory sample taken on a GPU carries the caching allocator's own count: the
    tracker's categories (logical bytes) never exceed what the allocator handed out."""
    samples = [s for s in res.memory if "device" in s]
    assert len(samples) == len(res.memory), "a CUDA sample without the allocator's count"
    for s in samples:
        d = s["device"]
        assert d["tracked"] == sum(s["bytes"].values())
        assert d["tracked"] <= d["allocated"] <= d["max_allocated"], (s["label"], d)
        assert d["allocated"] <= d["reserved"], (s["label"], d)


@pytest.mark.skipif(GPUS < 8, reason="3D needs 8 GPUs")
def test_three_d_on_nccl(tmp_path):
    trace = tmp_path / "trace.json"
    args = "parallel_lab.scripts.three_d --dp 2 --tp 2 --pp 2 --steps 2".split()
    out = _run([str(BIN / "torchrun"), "--nproc-per-node", "8", "-m", *args, "--trace", str(trace)])
    assert out.returncode == 0 and "matches single-process training" in out.stdout, out.stderr[-4000:]
    _cross_check_memory(RunResult.load(str(trace)))


NOTEBOOK_PARENT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import parallel_lab as pl
    from parallel_lab import comms
    torch.cuda.is_available()  # a notebook's first cell: the driver is initialised here

    def f(ctx):
        t = torch.full((1 << 20,), float(ctx.rank + 1), device=ctx.device)
        comms.ring_all_reduce(ctx, t)
        h = comms.dist_all_reduce(ctx, t.clone(), async_op=True)
        return t[0].item(), h.wait()[0].item(), str(ctx.device)

    res = pl.launch(f, 2)
    spans = [e for e in res.timeline if e["kind"] == "comm"]
    print(res.backend, res.values, min(e["end"] - e["start"] for e in spans) > 0)
    """
)


def test_launch_from_a_parent_that_touched_cuda():
    out = _run([sys.executable, "-c", NOTEBOOK_PARENT])
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "nccl [(3.0, 6.0, 'cuda:0'), (3.0, 6.0, 'cuda:1')] True", out.stdout


@pytest.mark.parametrize("lesson", sorted(p.name for p in (REPO / "solutions").glob("[0-9]*.ipynb")))
def test_exercise_checks_on_gpus(lesson):
    out = _run([sys.executable, "-m", "parallel_lab", "grade", str(REPO / "solutions" / lesson)])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]


def _allocate_and_sample(ctx):
    import torch

    x = torch.randn(1024, 1024, device=ctx.device)  # 4 MiB on this rank's GPU
    ctx.recorder.sample_memory("after a 4 MiB tensor")
    return {"max_allocated": torch.cuda.max_memory_allocated(ctx.device), "numel": x.numel()}


def test_memory_samples_carry_the_cuda_allocator():
    """On a GPU the same memory samples also hold the caching allocator's counts, which plot_memory
    draws; the tracker's categories never exceed what the allocator handed out."""
    from parallel_lab import launch

    r = launch(_allocate_and_sample, 2, track_memory=True, backend="nccl")
    dev = [s for s in r.memory if s.get("device")]
    assert {s["rank"] for s in dev} == {0, 1}
    for s in dev:
        assert s["device"]["allocated"] >= sum(s["bytes"].values())
    assert all(v["max_allocated"] >= 4 * 2**20 for v in r.values)
