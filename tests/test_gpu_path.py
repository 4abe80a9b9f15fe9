"""The GPU path, checked on a CPU machine: what NCCL and CUDA demand, asserted without a GPU.

gloo forgives what NCCL does not: CPU tensors in a collective, point-to-point messages matched
by tag rather than by order, a fork after the parent touched CUDA, host-clock timing of
asynchronous kernels. These tests hold the code to NCCL's rules on a laptop; the `gpu` tests
(tests/test_gpu.py) run the families on real GPUs when a machine has them.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import parallel_lab as pl
from parallel_lab.runtime import device as dev
from parallel_lab.runtime import from_env
from parallel_lab.runtime.context import _to_cpu
from parallel_lab.runtime.launch import choose_start_method

PKG = Path(__file__).resolve().parents[1] / "parallel_lab"
P2P = {"isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp"}


def test_point_to_point_is_posted_in_one_place():
    """Only comms/core.py's post_p2p calls torch.distributed's point-to-point functions."""
    found = []
    for f in PKG.rglob("*.py"):
        if f == PKG / "comms" / "core.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in P2P:
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("dist", "torch_dist"):
                    found.append(f"{f.relative_to(PKG)}:{node.lineno}: dist.{node.attr}")
    assert not found, "point-to-point outside comms.post_p2p:\n" + "\n".join(found)


def test_no_cuda_synchronize_in_the_pipeline_executor():
    src = (PKG / "pipeline" / "executor.py").read_text()
    assert "synchronize(" not in src


@pytest.mark.parametrize(
    "backend, threads, want", [("gloo", None, "fork"), ("gloo", 2, "spawn"), ("nccl", None, "spawn")]
)
def test_start_method(backend, threads, want):
    assert choose_start_method("auto", backend, threads) == want


def test_nccl_spawns_even_after_the_parent_asked_is_available(monkeypatch):
    """A notebook that called torch.cuda.is_available() has initialised the driver without
    torch.cuda.is_initialized() saying so: a forked NCCL rank would fail at its first CUDA call."""
    torch.cuda.is_available()  # what a notebook does first
    monkeypatch.setattr(dev, "gpu_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    backend = dev.resolve_backend("auto", 2)
    assert backend == "nccl"
    assert choose_start_method("auto", backend, None) == "spawn"
    with pytest.raises(ValueError, match="cannot run NCCL ranks"):
        choose_start_method("fork", backend, None)


def test_gpu_count_does_not_initialise_cuda():
    dev.gpu_count()
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(
    "env, gpus, want",
    [
        ({}, 0, "gloo"),
        ({}, 2, "nccl"),
        ({"ACCELERATE_USE_CPU": "true"}, 2, "gloo"),
        ({"ACCELERATE_USE_CPU": "1"}, 2, "gloo"),
    ],
)
def test_script_backend(monkeypatch, env, gpus, want):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dev, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert from_env.env_backend("auto") == want
    assert from_env.env_backend("gloo") == "gloo"  # an explicit backend wins


def test_local_rank_is_required_with_several_gpus(monkeypatch):
    monkeypatch.setattr(dev, "gpu_count", lambda: 4)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set and 4 GPUs are visible"):
        dev.local_cuda_index(None)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 but only 4"):
        dev.local_cuda_index(5)
    assert dev.local_cuda_index(3) == 3
    monkeypatch.setattr(dev, "gpu_count", lambda: 1)  # srun --gpus-per-task=1: each rank sees one
    assert dev.local_cuda_index(None) == 0 and dev.local_cuda_index(3) == 0


def test_group_kwargs_bind_nccl_to_the_device():
    assert dev.group_kwargs(torch.device("cpu")) == {}
    assert dev.group_kwargs(torch.device("cuda", 1)) == {"device_id": torch.device("cuda", 1)}


class _Pair(NamedTuple):
    a: torch.Tensor
    b: int


@dataclasses.dataclass(frozen=True)
class _Box:
    t: torch.Tensor
    items: list


def test_results_are_moved_to_the_cpu_inside_containers(monkeypatch):
    """NamedTuples and dataclasses (frozen too) are walked: every tensor inside goes through .cpu()."""
    moved = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: moved.append(self.numel()) or real(self))
    t = torch.ones(3)
    out = _to_cpu({"p": _Pair(t, 1), "box": _Box(t, [t, (t,)])})
    assert len(moved) == 4
    assert isinstance(out["p"], _Pair) and out["p"].b == 1 and isinstance(out["box"], _Box)
    assert isinstance(out["box"].items[1], tuple)


def _wrong_device(ctx):
    from parallel_lab import comms

    t = torch.ones(4, device="meta")  # not ctx.device: as a CPU tensor is not, under NCCL
    comms.ring_all_reduce(ctx, t)


def test_a_tensor_off_the_rank_device_is_a_clear_error():
    with pytest.raises(
        pl.RankError,
        match=r"tensor is on meta but this rank computes on cpu: create it with device=ctx.device",
    ):
        pl.launch(_wrong_device, 2, timeout=60)


def test_cpu_spans_use_the_host_clock():
    from parallel_lab.runtime.trace import Recorder

    rec = Recorder()
    assert rec.clock is None and isinstance(rec.mark(), float)
    with rec.span("x"):
        pass
    assert rec.events and not rec.pending and "clock" not in rec.events[0]["args"]


def test_device_marks_wait_for_resolve():
    """A device clock's spans stay pending until resolve(); then they carry their clock."""
    from parallel_lab.runtime.trace import Recorder

    class FakeClock:  # stands in for CudaEventClock: marks are objects, read back later
        def mark(self):
            return object()

        def seconds(self, mark):
            return 1.5

    rec = Recorder(clock=FakeClock())
    with rec.span("kernel"):
        pass
    assert not rec.events and len(rec.pending) == 1
    rec.resolve()
    assert rec.events[0]["start"] == rec.events[0]["end"] == 1.5
    assert rec.events[0]["args"]["clock"] == "cuda_event"


#: Where a literal "cpu" device is right, and why. Anything else is a rank's tensor pinned to the
#: host, which works on gloo and breaks under NCCL (one GPU per rank).
HOST_ON_PURPOSE = {
    "runtime/device.py": "the one place that chooses devices",
    "runtime/memory.py": "a tracker made outside a rank, with no device given, watches the host",
    "pipeline/executor.py": "the send reaper's default when no device is given (ranks pass ctx.device)",
    "comms/builtin.py": "the comm thread's default when no device is given (ranks pass ctx.device)",
    "precision/mixed.py": "the found-inf flag of an optimizer with no gradients and no context",
    "offload/streaming.py": "offloading keeps the weights in host memory by design",
    "offload/host_optimizer.py": "ZeRO-Offload's optimizer runs on the host by design",
    "grading/checks/moe.py": "a check's reference experts, computed in the grading process",
}


def _hard_coded(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
                found.append((node.lineno, ".cuda()"))
            values = [*node.args, *(k.value for k in node.keywords if k.arg in (None, "device"))]
            if any(isinstance(v, ast.Constant) and v.value == "cpu" for v in values):
                found.append((node.lineno, '"cpu" passed as a device'))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args[len(node.args.args) - len(node.args.defaults) :]
            for a, d in zip(args + node.args.kwonlyargs, node.args.defaults + node.args.kw_defaults):
                if a.arg == "device" and isinstance(d, ast.Constant) and d.value == "cpu":
                    found.append((node.lineno, 'device="cpu" as a default'))
    return found


def test_no_hard_coded_devices():
    """No `.cuda()` and no literal "cpu" device outside the files that need one (each with its reason)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel in HOST_ON_PURPOSE:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in _hard_coded(ast.parse(path.read_text()))]
    assert not bad, "hard-coded devices:\n" + "\n".join(bad)
    # the scan finds what it is for
    sample = ast.parse('x.cuda()\ntorch.zeros(3, device="cpu")\ny.to("cpu")\ndef f(device="cpu"): pass\n')
    assert sorted(_hard_coded(sample)) == [
        (1, ".cuda()"), (2, '"cpu" passed as a device'), (3, '"cpu" passed as a device'), (4, 'device="cpu" as a default')
    ]  # fmt: skip


def test_doctor_reports_the_gpu_path(capsys):
    from parallel_lab.__main__ import doctor, lesson_backends

    doctor(None)
    out = capsys.readouterr().out
    for field in ("cuda", "nccl", "gpus", "backend", "lessons"):
        assert re.search(rf"^\s*{field}\b", out, re.M), f"doctor does not report {field}:\n{out}"
    plan = {name: (ranks, chosen) for name, ranks, chosen in lesson_backends(8)}
    assert plan["10_three_d"] == (8, "nccl (one GPU per rank)")
    assert lesson_backends(2)[0][2].startswith("gloo (needs")
    assert all(chosen.startswith("gloo") for _, _, chosen in lesson_backends(0))
