"""One GPU, the commonest learner machine: `make gpu-check` (or `pytest -m gpu tests/test_gpu_one.py`).

What a single GPU can say that a CPU cannot: a world-size-1 NCCL launch from a notebook-like parent
that already asked CUDA a question; spans timed on the device clock (a kernel that sleeps tens of ms
must show tens of ms, however fast the host issued it); the tracker against the caching allocator on
real work (not vacuously: bytes are tracked); weight streaming bit-exact from pinned host copies on
a copy stream; the fp8 GEMM at shapes CUDA accepts and at shapes it does not; recomputation with
dropout (the CUDA RNG state replayed); a built-in all-reduce's span ending at its own completion
under compute; a checkpoint saved by an NCCL rank read back on the CPU; gloo ranks that run a
backward after the parent ran one; the backend rule with more ranks than GPUs; the lesson scripts at
one rank on NCCL. Each check is one test, so pytest -v prints a line per check.
Without a GPU they are skipped; tests/test_gpu.py holds the checks that need 2+ GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import parallel_lab as pl
from parallel_lab.runtime import device as dev

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, wherever this python keeps it
GPUS = dev.gpu_count()  # counted without creating a CUDA context in this process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a GPU, and -m gpu (the CPU suite hides GPUs)"),
]


def _run(cmd: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


PARENT = textwrap.dedent(
    """
    import torch
    import parallel_lab as pl
    from parallel_lab import comms
    torch.cuda.is_available()  # a notebook's first cell: the driver is initialised here

    def f(ctx):
        t = torch.full((1 << 20,), 2.0, device=ctx.device)
        comms.ring_all_reduce(ctx, t)
        h = comms.dist_all_reduce(ctx, t.clone(), async_op=True)
        return t[0].item(), h.wait()[0].item(), str(ctx.device)

    res = pl.launch(f, 1)
    comm = [e for e in res.timeline if e["kind"] == "comm"]
    print(res.backend, res.values, bool(comm) and all(e["args"].get("clock") == "cuda_event" for e in comm))
    """
)


def test_world_size_1_launches_nccl_from_a_parent_that_touched_cuda():
    out = _run([sys.executable, "-c", PARENT])
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "nccl [(2.0, 2.0, 'cuda:0')] True", out.stdout


def _sleep_span(ctx, cycles: int):
    import time

    from parallel_lab.runtime.device import Stopwatch

    torch.ones(1, device=ctx.device).sum().item()  # context and clock warm
    watch = Stopwatch(ctx.device)
    t0 = time.perf_counter()
    with ctx.recorder.span("sleep", "compute"), watch():
        torch.cuda._sleep(cycles)  # the GPU spins; the host returns at once
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued, watch.seconds


def test_spans_are_timed_on_the_device_clock():
    res = pl.launch(_sleep_span, 1, 200_000_000)  # 200M cycles: about 0.1 s at 2 GHz
    (span,) = [e for e in res.timeline if e["name"] == "sleep"]
    length, (issued, watched) = span["end"] - span["start"], res.values[0]
    assert abs(watched - length) < 0.2 * length, (watched, length)  # the Stopwatch reads the same clock
    assert span["args"].get("clock") == "cuda_event"
    assert length > 0.03, (
        f"a 200M-cycle sleep spanned {length * 1e3:.2f} ms: the span ended when it was queued"
    )
    assert issued < length / 2, (issued, length)


def _tracked_step(ctx):
    from parallel_lab.models import MLPConfig, build_model, synthetic_batch

    cfg = MLPConfig()
    model = build_model(cfg, seed=0, device=ctx.device)
    ctx.memory.register_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.memory.register_optimizer(opt)
    x, y = synthetic_batch(
        "regression", 64, in_dim=cfg.in_dim, out_dim=cfg.out_dim, seed=1, device=ctx.device
    )
    for _ in range(2):
        with ctx.recorder.span("step", "compute"):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return loss.item()


def test_memory_tracker_against_the_caching_allocator():
    res = pl.launch(_tracked_step, 1, track_memory=True)
    assert res.backend == "nccl"
    samples = [s for s in res.memory if "device" in s]
    assert samples and len(samples) == len(res.memory), "a CUDA sample without the allocator's count"
    assert max(s["device"]["tracked"] for s in samples) > 0, "the tracker saw nothing on the GPU"
    for s in samples:
        d = s["device"]
        assert d["tracked"] == sum(s["bytes"].values())
        assert d["tracked"] <= d["allocated"] <= d["max_allocated"] <= d["reserved"], (s["label"], d)
    for cat in ("param", "optim", "activation"):
        assert max(s["bytes"].get(cat, 0) for s in samples) > 0, f"no {cat} bytes seen on the GPU"


def _streamed(ctx):
    import copy

    from parallel_lab.models import GPTConfig, build_model
    from parallel_lab.offload import WeightStreamer

    cfg = GPTConfig()
    model = build_model(cfg, seed=0, device=ctx.device).eval()
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0)).to(
        ctx.device
    )
    with torch.no_grad():
        want = model(idx)
        streamed = copy.deepcopy(model)
        budget = 3 * max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in streamed.blocks)
        ws = WeightStreamer(ctx, streamed, budget_bytes=budget + (1 << 22))
        got = streamed(idx)
    pinned = all(t.is_pinned() for t in ws.host_copy.values())
    return torch.equal(want, got), pinned, ws.h2d_bytes


def test_weight_streaming_is_bit_exact_from_pinned_host_copies():
    equal, pinned, moved = pl.launch(_streamed, 1).values[0]
    assert pinned, "host copies are pageable: a copy stream cannot overlap them with compute"
    assert moved > 0 and equal


def _fp8(ctx):
    from parallel_lab.precision.fp8_linear import Fp8Linear, fp8_mm

    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k, m in [(32, 64, 48), (7, 40, 20)]:  # CUDA's rule met, and broken in every dimension
        a = torch.randn(n, k, generator=g).to(ctx.device).to(torch.float8_e4m3fn)
        b = torch.randn(k, m, generator=g).to(ctx.device).to(torch.float8_e4m3fn)
        sim, hw = fp8_mm(a, 1.0, b, 1.0, "simulated"), fp8_mm(a, 1.0, b, 1.0, "scaled_mm")
        out[(n, k, m)] = float((sim - hw).abs().max() / sim.abs().max())
    lin = torch.nn.Linear(40, 20).to(ctx.device)
    layer = Fp8Linear.from_linear(lin, recipe="current", matmul="scaled_mm")
    x = torch.randn(7, 40, device=ctx.device, requires_grad=True)
    layer(x).square().sum().backward()  # the backward's token dimension (7) is an inner one
    return out, bool(torch.isfinite(x.grad).all())


@pytest.mark.skipif(
    GPUS > 0 and torch.cuda.get_device_capability(0) < (8, 9) if GPUS else True,
    reason="fp8 tensor cores need compute capability 8.9+",
)
def test_fp8_scaled_mm_at_accepted_and_refused_shapes():
    rel, finite = pl.launch(_fp8, 1).values[0]
    print("fp8 simulated vs _scaled_mm, max diff / max |out|:", rel)
    assert finite
    # the same fp8 values, accumulated in another order by the tensor cores: close, not equal
    assert all(r < 1e-3 for r in rel.values()), rel


def _recompute_with_dropout(ctx):
    from parallel_lab.checkpointing import checkpoint_sequential

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.3))
            for _ in range(4)
        ]
    ).to(ctx.device)
    x = torch.randn(16, 64, device=ctx.device, requires_grad=True)
    grads = []
    for ckpt in (False, True):
        torch.cuda.manual_seed(1)
        y = checkpoint_sequential(blocks, 2, x, checkpoint_last=True) if ckpt else blocks(x)
        y.square().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())])
        x.grad = None
        blocks.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(*grads))


def test_recomputation_replays_cuda_dropout():
    assert pl.launch(_recompute_with_dropout, 1).values[0]


def _save_on_gpu(ctx, root: str):
    from parallel_lab.resilience import checkpoint as ckpt

    ckpt.save(ctx, root, 3, {"w": torch.arange(6.0, device=ctx.device)}, meta={"k": 1})
    return str(ctx.device)


def test_checkpoint_saved_by_an_nccl_rank_reads_back_on_the_cpu(tmp_path):
    from parallel_lab.resilience import checkpoint as ckpt

    assert pl.launch(_save_on_gpu, 1, str(tmp_path)).values[0] == "cuda:0"
    d, manifest, _ = ckpt.latest(tmp_path)
    shard = ckpt.read_shard(d, 0, manifest)
    assert shard["w"].device.type == "cpu" and torch.equal(shard["w"], torch.arange(6.0))


BACKWARD_THEN_RANKS = textwrap.dedent(
    """
    import os
    import torch
    import parallel_lab as pl
    from multiprocessing import forkserver

    def f(ctx):
        w = torch.ones(4, requires_grad=True)
        (w * (ctx.rank + 1)).sum().backward()  # every rank's own backward, on gloo
        return w.grad.sum().item()

    def g(ctx):
        w = torch.ones(4, device=ctx.device, requires_grad=True)
        (w * 2).sum().backward()  # a backward on the GPU, in a child of the same server
        return w.grad.sum().item()

    if __name__ == "__main__":
        torch.ones(3, requires_grad=True).sum().backward()  # a notebook's own backward, first
        res = pl.launch(f, 2, backend="gloo")
        print(res.backend, res.values)
        res = pl.launch(g, 1)  # the server started above forks this rank too
        print(res.backend, res.values)
        # the server never initialised the driver: cuInit opens /dev/nvidiactl and /dev/nvidia<k>, and
        # a driver initialised there would break every child's first CUDA call. (Mapping libcuda.so is
        # not that: `import torch` alone maps it with a CUDA 13 build, in a spawned process too.)
        def device_files(pid):
            found = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except FileNotFoundError:  # listdir's own descriptor, closed since
                    pass
            return sorted(f for f in found if f.startswith("/dev/nvidia"))

        print("server device files:", device_files(forkserver._forkserver._forkserver_pid))
        torch.cuda.init()  # the probe itself: a process that did initialise the driver shows them
        print("initialised here:", bool(device_files(os.getpid())))
    """
)


def test_gloo_ranks_backward_after_the_parent_ran_one():
    """On a GPU machine the parent's first backward starts autograd's per-GPU threads; ranks
    forked after it would fail at their own backward. The launcher starts them from a forkserver
    instead, which must stay clean enough for a GPU rank forked from it later."""
    out = _run([sys.executable, "-c", BACKWARD_THEN_RANKS])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "gloo [4.0, 8.0]" in out.stdout, out.stdout
    assert "nccl [8.0]" in out.stdout, out.stdout
    assert "server device files: []" in out.stdout, out.stdout  # its children are as clean as spawned ones
    assert "initialised here: True" in out.stdout, out.stdout


def test_more_ranks_than_gpus_fall_back_to_gloo():
    """torchrun with 2 ranks per GPU: gloo on the CPU (said), not NCCL failing on a duplicate GPU."""
    n = GPUS + 1
    out = _run([*TORCHRUN, "--nproc-per-node", str(n), "-m", "parallel_lab.scripts.collectives"])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "all collectives match torch.distributed" in out.stdout
    assert f"{n} ranks on this machine but {GPUS} GPU(s)" in out.stderr


ONE_RANK = {
    "ddp": (["parallel_lab.scripts.ddp", "--steps", "2"], "identical weights on every rank: True"),
    "zero3": ("parallel_lab.scripts.zero --stage 3 --steps 2".split(), "identical weights on every rank"),
    "offload": ("parallel_lab.scripts.zero --offload --steps 2".split(), "identical weights on every rank"),
    "1f1b": ("parallel_lab.scripts.pipeline --schedule 1f1b --steps 2".split(), "losses match"),
    "mixed_precision": (["parallel_lab.scripts.mixed_precision", "--steps", "4", "--overflow-at", "2"],
                        "identical weights: True"),
    "quantization": (["parallel_lab.scripts.quantization"], "matches single-process quantized inference"),
    "fewer_bytes": (["parallel_lab.scripts.fewer_bytes", "--steps", "3"], "every rank holds the same weights"),
    "moe_at_scale": (["parallel_lab.scripts.moe_at_scale"], "MoE at scale matches the single-process layer"),
}  # fmt: skip


@pytest.mark.parametrize("family", list(ONE_RANK))
def test_script_at_one_rank_on_nccl(family, tmp_path):
    args, ok = ONE_RANK[family]
    trace = tmp_path / "trace.json"
    out = _run([*TORCHRUN, "--nproc-per-node", "1", "-m", *args, "--trace", str(trace)])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert ok in out.stdout, out.stdout[-3000:]
    assert pl.RunResult.load(str(trace)).backend == "nccl"


def _spun(ctx):
    from parallel_lab.runtime.device import Stopwatch, spin

    watch = Stopwatch(ctx.device)
    with watch():
        spin(ctx.device, 0.05)  # the pipeline's emulated compute cost on a GPU
    return watch.seconds


def test_spin_keeps_the_gpu_busy_for_the_time_asked():
    assert 0.035 < pl.launch(_spun, 1).values[0] < 0.08


def _reduce_under_compute(ctx):
    from parallel_lab.comms import AsyncAllReduce
    from parallel_lab.runtime.device import spin

    x = torch.ones(1 << 20, device=ctx.device)  # (1M,)
    h = AsyncAllReduce(ctx, x)  # what a DDP bucket's hook issues
    with ctx.recorder.span("bwd rest", "compute"):
        spin(ctx.device, 0.1)  # the rest of backward, queued after the issue on the compute stream
    h.wait()
    return x[0].item()


def test_a_built_in_all_reduce_span_ends_when_the_reduction_does():
    """The comm span ends at the reduction's completion (an event on a side stream that waits for it
    alone), not at an event on the compute stream after the backward it overlaps (which made
    comm_hidden_fraction read about 1 whatever happened)."""
    res = pl.launch(_reduce_under_compute, 1)
    (comm,) = [e for e in res.timeline if e["kind"] == "comm"]
    (bwd,) = [e for e in res.timeline if e["name"] == "bwd rest"]
    assert res.values == [1.0] and comm["args"].get("clock") == "cuda_event"
    assert comm["end"] - comm["start"] < 0.5 * (bwd["end"] - bwd["start"]), (comm, bwd)
