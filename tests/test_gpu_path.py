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
import sys
from pathlib import Path
from typing import NamedTuple

import nbformat
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
    "backend, threads, want",
    [("gloo", None, "fork"), ("gloo", 2, "forkserver"), ("nccl", None, "forkserver")],
)
def test_start_method(backend, threads, want):
    assert choose_start_method("auto", backend, threads) == want


def test_nccl_never_forks_even_after_the_parent_asked_is_available(monkeypatch):
    """A notebook that called torch.cuda.is_available() has initialised the driver without
    torch.cuda.is_initialized() saying so: a forked NCCL rank would fail at its first CUDA call."""
    torch.cuda.is_available()  # what a notebook does first
    monkeypatch.setattr(dev, "gpu_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    backend = dev.resolve_backend("auto", 2)
    assert backend == "nccl"
    assert choose_start_method("auto", backend, None) == "forkserver"
    with pytest.raises(ValueError, match="cannot run NCCL ranks"):
        choose_start_method("fork", backend, None)


def test_gloo_ranks_never_fork_on_a_machine_with_a_gpu(monkeypatch):
    """Ranks forked after this process's first backward on a GPU machine fail at their own
    backward (autograd's per-GPU threads do not survive fork): gloo ranks come from the forkserver
    there too (on Linux; spawn elsewhere)."""
    monkeypatch.setattr(dev, "gpu_count", lambda: 1)
    assert choose_start_method("auto", "gloo", None) == "forkserver"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert choose_start_method("auto", "gloo", None) == "spawn"


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


def _machine(monkeypatch, gpus: int, env: dict[str, str]) -> None:
    """Fake a machine with `gpus` GPUs (NCCL present) and these launcher variables."""
    for k in ("ACCELERATE_USE_CPU", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dev, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


@pytest.mark.parametrize(
    "gpus, local_ranks, env, want",
    [
        (0, 1, {}, "gloo"),
        (1, 1, {}, "nccl"),  # a laptop with one GPU, a 1-rank cell: one rank, one GPU
        (1, 2, {}, "gloo"),  # two ranks, one GPU: NCCL would fail in init (duplicate GPU)
        (1, 4, {}, "gloo"),
        (2, 2, {}, "nccl"),
        (2, 3, {}, "gloo"),
        (8, 1, {}, "nccl"),
        (1, 1, {"ACCELERATE_USE_CPU": "true"}, "gloo"),
        (2, 2, {"ACCELERATE_USE_CPU": "1"}, "gloo"),
    ],
)
def test_one_backend_rule_for_launch_and_launchers(monkeypatch, gpus, local_ranks, env, want):
    """launch(world_size=n) and a launcher's ranks (LOCAL_WORLD_SIZE=n) choose alike, on a faked
    machine of 0, 1, 2 or 8 GPUs."""
    _machine(monkeypatch, gpus, env)
    assert dev.resolve_backend("auto", local_ranks) == want
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # torchrun / accelerate launch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setenv("LOCAL_RANK", "1")  # not local rank 0: says nothing
    assert from_env.env_backend("auto") == want


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "3"}, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}])
def test_srun_tasks_shown_one_gpu_each_keep_nccl(monkeypatch, env):
    """srun --gpus-per-task=1 without torchrun, or submitit (which exports LOCAL_WORLD_SIZE too, but
    is no torch elastic launcher): each task sees a GPU of its own, so one GPU proves no sharing."""
    _machine(monkeypatch, 1, env)
    assert from_env.env_backend("auto") == "nccl"
    assert dev.local_cuda_index(3) == 0


def test_more_local_ranks_than_gpus_falls_back_and_says_so(monkeypatch, capsys):
    _machine(monkeypatch, 1, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    assert from_env.env_backend("auto") == "gloo"
    assert "2 ranks on this machine but 1 GPU(s)" in capsys.readouterr().err
    # an explicit backend="nccl" gets a clear error, not NCCL's duplicate-GPU failure
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE=2 ranks on this machine but 1 GPU"):
        dev.local_cuda_index(1)


def test_local_nodes_get_their_own_gpus_or_the_cpu(monkeypatch):
    from parallel_lab.runtime.cluster import node_devices

    _machine(monkeypatch, 4, {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [node_devices(i, 2, 2) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert node_devices(1, 2, 2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    _machine(monkeypatch, 1, {})
    assert node_devices(0, 2, 2) == node_devices(1, 2, 2) == {"ACCELERATE_USE_CPU": "true"}
    _machine(monkeypatch, 0, {})
    assert node_devices(0, 2, 2) == {}


def test_seeded_builds_leave_the_gpu_generators_alone(monkeypatch):
    """torch.manual_seed also resets every CUDA generator to its seed, which fork_rng(devices=[]) does
    not restore: a rank's CUDA draws would restart from the model's seed after each build. Seeded
    builds touch the CPU generator only."""
    from parallel_lab.models import GPTConfig, build_model
    from parallel_lab.moe import MoEConfig, build_moe

    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append(s))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: calls.append(s))
    a = build_model(GPTConfig(), seed=3)
    build_moe(MoEConfig(), seed=3)
    b = build_model(GPTConfig(), seed=3)
    assert calls == []
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    torch.manual_seed(0)  # the check itself: a plain manual_seed is seen
    assert calls == [0]


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

        def done(self, mark):
            return False  # still queued on the GPU

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
    "grading/checks/precision.py": "torch.amp.GradScaler('cpu'): the check measures the scaler in the grading process",
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


def test_doctor_reports_the_gpu_path(monkeypatch):
    """The doctor names the GPUs, which initialises CUDA: it runs in a process of its own, so this
    one (which forks NCCL ranks in other tests) keeps no CUDA context."""
    import subprocess
    import sys

    from parallel_lab.__main__ import lesson_backends

    done = subprocess.run(
        [sys.executable, "-m", "parallel_lab", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for field in ("cuda", "nccl", "gpus", "backend", "lessons"):
        assert re.search(rf"^\s*{field}\b", out, re.M), f"doctor does not report {field}:\n{out}"
    plan = {name: (sizes, chosen) for name, sizes, chosen in lesson_backends(8)}
    assert max(plan["10_three_d"][0]) == 8 and plan["10_three_d"][1] == "nccl (one GPU per rank)"
    assert 4 in plan["04_zero"][0] and 4 in plan["20_hsdp"][0]  # launched with a name bound to 4 (N = 4)
    assert all(chosen.startswith(("gloo (CPU", "gloo (set")) for _, _, chosen in lesson_backends(0))
    assert plan["21_moe_at_scale"][1] == "gloo (set in the lesson)"  # every launch there names backend="gloo"
    # one GPU: a lesson whose cells launch 1 and 2 ranks gets NCCL for the first, gloo for the second
    one = {name: (sizes, chosen) for name, sizes, chosen in lesson_backends(1)}
    mixed = [n for n, (sizes, _) in one.items() if 1 in sizes and max(sizes) > 1]
    assert mixed, one
    assert one[mixed[0]][1].startswith("1 rank: nccl; ") and "gloo" in one[mixed[0]][1], one[mixed[0]]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert all(chosen.startswith("gloo") for _, _, chosen in lesson_backends(8))


def test_scaled_mm_meets_cudas_shape_rule_at_any_token_count(monkeypatch):
    """On CUDA, torch._scaled_mm wants every dimension of both operands a multiple of 16 (an H100
    refused a 32x40 operand: "trailing dimension of mat1 to be divisible by 16"); the CPU kernel
    asks nothing. The backward makes the token count an inner dimension, so a batch of 7 tokens
    must work too: the rule is modelled here and the layer must keep it on every device."""
    from parallel_lab.precision.fp8_linear import Fp8Linear

    real = torch._scaled_mm
    shapes = []

    def cuda_rule(a, b, **kw):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        bad = [d for d in (*a.shape, *b.shape) if d % 16]
        if bad:
            raise RuntimeError(f"dimensions {tuple(a.shape)} @ {tuple(b.shape)} not divisible by 16")
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rule)
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 20)
    x = torch.randn(7, 40, requires_grad=True)
    out = {}
    for how in ("simulated", "scaled_mm"):
        layer = Fp8Linear.from_linear(lin, recipe="current", matmul=how)
        xi = x.detach().clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        out[how] = (y.detach(), xi.grad, layer.weight.grad)
    assert len(shapes) == 3  # forward, dX, dW all went through the fp8 GEMM
    for a, b in zip(out["simulated"], out["scaled_mm"]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- NCCL's blocking sends
def _posting_log(ctx, fn, *args):
    """Run `fn(ctx, *args)` recording every batch this rank posts, as ("send" | "recv", peer)."""
    import parallel_lab.comms as C
    import parallel_lab.comms.core as core
    import parallel_lab.comms.p2p as P

    log, real = [], core.post_p2p

    def recording(group, sends=(), recvs=(), tag=0):
        batch = [("recv", core._global(group, m[1])) for m in recvs if m[0].numel() > 0]
        batch += [("send", core._global(group, m[1])) for m in sends if m[0].numel() > 0]
        if batch:
            log.append(batch)
        return real(group, sends, recvs, tag)

    for mod in (core, C, P):
        mod.post_p2p = recording  # this rank's process only (a forked copy of the modules)
    fn(ctx, *args)
    return log


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)])
def test_pipeline_executor_posts_what_nccl_cannot_deadlock_on(schedule, chunks):
    """What the executor really posts on each rank, run through NCCL's rules (a send completes
    only once its receive is posted; each rank's batches in posting order): no deadlock. Posting
    each message alone in list order (the executor before) deadlocks 1F1B and interleaved."""
    from parallel_lab.comms import check_blocking_sends
    from parallel_lab.pipeline import PipelineConfig, make_schedule, train_pipeline
    from parallel_lab.pipeline import check_blocking_sends as check_lists

    cfg = PipelineConfig(schedule=schedule, microbatches=4, chunks=chunks, layers=8, batch=8, steps=1)
    logs = pl.launch(_posting_log, 2, train_pipeline, cfg).values
    assert sum(map(len, logs)) > 0
    check_blocking_sends(logs)
    lists = make_schedule(schedule, 2, 4, chunks)
    if schedule != "gpipe":
        with pytest.raises(pl.pipeline.ScheduleError, match="deadlock under blocking sends"):
            check_lists(lists, fused=False)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_pipeline_serving_posts_what_nccl_cannot_deadlock_on(microbatches):
    from parallel_lab.comms import check_blocking_sends
    from parallel_lab.inference import ServingGPT, pp_generate
    from parallel_lab.models import GPTConfig, build_model

    cfg = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    s = ServingGPT.from_gpt(build_model(cfg, 0).eval(), 2)
    prompt = torch.randint(cfg.vocab, (4, 5), generator=torch.Generator().manual_seed(1))
    for ranks in (2, 4):
        check_blocking_sends(pl.launch(_posting_log, ranks, pp_generate, s, prompt, 6, microbatches).values)


def test_the_blocking_send_model_finds_the_cross_posted_pair():
    """The model itself: two ranks each sending before receiving deadlock; a batch of both does not."""
    from parallel_lab.comms import check_blocking_sends

    with pytest.raises(RuntimeError, match="deadlock under blocking sends"):
        check_blocking_sends([[[("send", 1)], [("recv", 1)]], [[("send", 0)], [("recv", 0)]]])
    check_blocking_sends([[[("send", 1), ("recv", 1)]], [[("send", 0), ("recv", 0)]]])
    check_blocking_sends([[[("send", 1)], [("recv", 1)]], [[("recv", 0)], [("send", 0)]]])


# ----------------------------------------------------------------------------- lesson cells on ctx.device
_FACTORIES = {"randn", "rand", "randint", "zeros", "ones", "empty", "full", "arange", "tensor", "linspace", "eye",
              "randperm"}  # fmt: skip
_LAUNCHERS = {"launch", "launch_learner", "run_script"}


def _launched_functions(tree: ast.AST) -> list[ast.FunctionDef]:
    """The functions a notebook hands to launch() (its first argument, by name)."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Name):
            f = n.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in _LAUNCHERS:
                names.add(n.args[0].id)
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names]


def _moved(node: ast.AST, parents: dict) -> bool:
    """True when a call's result goes through `.to(...)` before anything else uses it."""
    p = parents.get(node)
    while isinstance(p, (ast.Attribute, ast.Call)):
        if isinstance(p, ast.Attribute) and p.attr == "to":
            return True
        p = parents.get(p)
    return False


def _off_device(fn: ast.FunctionDef) -> list[tuple[int, str]]:
    """Tensors and models a rank function makes without ctx.device (NCCL would get CPU tensors)."""
    parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
    found = list(_hard_coded(fn))
    for n in ast.walk(fn):
        if not isinstance(n, ast.Call) or any(k.arg == "device" for k in n.keywords) or _moved(n, parents):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
            if f.attr in _FACTORIES:
                found.append((n.lineno, f"torch.{f.attr}(...) without device="))
        elif (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in (
            "build_model",
            "build_moe",
        ):
            found.append((n.lineno, "a model built without device="))
        elif (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) == "synthetic_batch":
            found.append((n.lineno, "a batch made without device="))
    for n in ast.walk(fn):  # a CUDA tensor has no .numpy(): it must come to the host first
        f = n.func if isinstance(n, ast.Call) else None
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "numpy"
            and not (
                isinstance(f.value, ast.Call)
                and isinstance(f.value.func, ast.Attribute)
                and f.value.func.attr == "cpu"
            )
        ):
            found.append((n.lineno, ".numpy() without .cpu() first"))
    return found


def _notebook_code(path: Path) -> str:
    cells = nbformat.read(path, as_version=4).cells
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.split("\n"))


LESSON_BOOKS = sorted((PKG.parent / "notebooks").glob("*.ipynb")) + sorted(
    (PKG.parent / "solutions").glob("*.ipynb")
)


@pytest.mark.parametrize("path", LESSON_BOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_lesson_rank_functions_work_on_ctx_device(path):
    """Every function a lesson or solution launches makes its tensors and models on ctx.device (or
    moves them there at once): on a GPU machine the ranks run NCCL, which takes no CPU tensor."""
    code = _notebook_code(path)
    lines = code.split("\n")
    bad = [f"{fn.name}: {what}: {lines[ln - 1].strip()}" for fn in _launched_functions(ast.parse(code))
           for ln, what in _off_device(fn)]  # fmt: skip
    assert not bad, "made off ctx.device:\n" + "\n".join(bad)


def test_the_lesson_scan_finds_what_it_is_for():
    sample = ast.parse(
        "def f(ctx):\n    a = torch.randn(3)\n    b = torch.randn(3).to(ctx.device)\n"
        "    m = build_model(cfg, 0)\n    n = build_model(cfg, 0, device=ctx.device)\n"
        "    mesh = init_device_mesh('cpu', (2,))\n    return a.detach().numpy(), b.cpu().numpy()\n\npl.launch(f, 2)\n"
    )
    (fn,) = _launched_functions(sample)
    assert sorted(_off_device(fn)) == [
        (2, "torch.randn(...) without device="), (4, "a model built without device="), (6, '"cpu" passed as a device'),
        (7, ".numpy() without .cpu() first"),
    ]  # fmt: skip


def test_stopwatch_adds_up_intervals_on_the_work_clock():
    import time

    watch = dev.Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with watch():
            time.sleep(0.02)
    assert 0.035 < watch.seconds < 0.5
    assert watch.seconds == watch.seconds  # reading twice adds nothing


def test_hang_report_under_nccl_says_queued_not_finished():
    e = pl.LaunchTimeout(5, {0: "all_reduce", 1: None}, backend="nccl")
    assert "queued on the GPU" in str(e) and "finished" not in e.doing(0)
    assert "had finished" in pl.LaunchTimeout(5, {0: "all_reduce"}).doing(0)


def test_weight_streaming_refuses_a_model_off_the_rank_device():
    from types import SimpleNamespace

    from parallel_lab.offload import WeightStreamer

    ctx = SimpleNamespace(device=torch.device("meta"), memory=None)
    with pytest.raises(ValueError, match="build it with device=ctx.device"):
        lin = torch.nn.Linear(4, 4)
        WeightStreamer(ctx, lin, budget_bytes=1 << 20, units=[lin])


class _FakeMark:
    """A CUDA event stand-in: `query()` says whether the GPU has passed it."""

    def __init__(self, t: float, passed: bool):
        self.t, self.passed = t, passed

    def query(self) -> bool:
        return self.passed


class _FakeClock:
    def done(self, mark) -> bool:
        return isinstance(mark, float) or mark.query()

    def seconds(self, mark) -> float:
        assert isinstance(mark, float) or mark.passed, "seconds() would wait for the GPU here"
        return mark if isinstance(mark, float) else mark.t


def test_device_timed_spans_reach_the_sink_as_soon_as_the_gpu_passed_them():
    """A live view (the sink) sees each device-timed span once the GPU has passed it, not only when
    the rank's function returns; a span still queued waits, and `resolve()` takes the rest."""
    from parallel_lab.runtime.trace import Recorder

    sent = []
    rec = Recorder(sink=lambda kind, ev: sent.append((kind, ev["name"])), clock=_FakeClock())
    rec.add_event("a", "compute", _FakeMark(0.0, True), _FakeMark(1.0, True))
    assert ("event", "a") in sent and rec.events[0]["end"] == 1.0
    late = _FakeMark(3.0, False)
    rec.add_event("b", "compute", _FakeMark(1.0, True), late)
    assert ("event", "b") not in sent and len(rec.pending) == 1
    late.passed = True
    rec.resolve()
    assert ("event", "b") in sent and rec.events[-1]["args"]["clock"] == "cuda_event"
