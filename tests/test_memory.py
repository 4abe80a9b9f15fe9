"""MemoryTracker: allocation-level counting, labels, peaks, registration, and real runs.

Expected byte counts are computed from shapes by hand (or from `costmodel`), never
read back from the tracker itself.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import parallel_lab as pl
from parallel_lab import costmodel
from parallel_lab.models import GPTConfig, MLPConfig, TinyGPT, build_model, synthetic_batch
from parallel_lab.runtime.memory import MemoryTracker
from parallel_lab.runtime.memory_state import (
    attach_hooks,
    count_bytes,
    measure_model_state,
    model_state_bytes_measured,
)
from parallel_lab.runtime.trace import CATEGORIES, Recorder


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ZERO = dict.fromkeys(CATEGORIES, 0)


def snap(**kw: int) -> dict[str, int]:
    return {**ZERO, **kw}


@pytest.fixture(params=["allocator", "dispatch"])
def mechanism(request) -> str:
    """Both ways of seeing allocations must count the same bytes."""
    return request.param


def test_snapshot_has_every_category_and_starts_empty(mechanism):
    with MemoryTracker(mechanism=mechanism) as mem:
        assert mem.snapshot() == ZERO
        assert mem.peak() == ZERO


def test_views_count_once_and_frees_subtract(mechanism):
    with MemoryTracker(mechanism=mechanism) as mem:
        a = torch.randn(1000)  # 4000 bytes, grad mode on -> activation
        b = a.view(10, 100)
        c = a[:10].t() if a.dim() == 2 else a[:10]
        d = a.unsqueeze(0).expand(3, 1000)
        assert mem.snapshot() == snap(activation=4000)
        del a, b, c
        gc.collect()
        assert mem.snapshot() == snap(activation=4000), "a view (d) still holds the storage"
        del d
        assert mem.snapshot() == ZERO
        assert mem.total() == 0


def test_peak_includes_temporaries(mechanism):
    x = torch.randn(256)  # before start: not counted
    with MemoryTracker(mechanism=mechanism) as mem:
        y = ((x * 2) + 1).sum()  # x*2 and (+1) are 1024-byte temporaries, y 4 bytes
        assert mem.snapshot() == snap(activation=4)
        # x*2 (1024) is alive while (+1) (1024) is made: peak 2048, then the sum
        # (4) is made while +1 is alive. The allocator also sees the 0-d tensors an op
        # wraps a Python number in, made and freed inside the op (a few bytes each).
        peak = sum(mem.peak().values())
        if mechanism == "dispatch":
            assert peak == 2048
        else:
            assert 2048 <= peak <= 2048 + 32, peak
        mem.reset_peak()
        assert mem.peak() == snap(activation=4)
    del y


def test_preexisting_tensors_are_not_counted_unless_registered(mechanism):
    p = torch.randn(100)  # 400 bytes made before start
    with MemoryTracker(mechanism=mechanism) as mem:
        _ = p.view(10, 10), p[:5], p.unsqueeze(1).t(), p.detach()
        p.mul_(2)  # in place: no allocation
        torch.add(p, 1, out=p)  # out= into an existing storage: no allocation
        assert mem.snapshot() == ZERO
        mem.register(p, "other")
        assert mem.snapshot() == snap(other=400)
        mem.register(p[10:], "comm")  # a view relabels the whole storage, no double count
        assert mem.snapshot() == snap(comm=400)


def test_labels_category_no_grad_and_python_data(mechanism):
    with MemoryTracker(mechanism=mechanism) as mem:
        with mem.category("comm"):
            buf = torch.empty(64)  # 256
            with mem.category("optim"):
                st = torch.zeros(8)  # 32, innermost label wins
        with torch.no_grad():
            tmp = torch.ones(16)  # 64 -> other
        lit = torch.tensor([1.0, 2.0, 3.0])  # 12, seen via aten.lift_fresh
        assert mem.snapshot() == snap(comm=256, optim=32, other=64, activation=12)
    del buf, st, tmp, lit


def test_out_and_resize_grow_a_tracked_storage(mechanism):
    with MemoryTracker(mechanism=mechanism) as mem:
        out = torch.empty(0)
        torch.cat([torch.ones(10), torch.ones(6)], out=out)  # out grows to 64 bytes
        del_me = None
        assert mem.snapshot() == snap(activation=64)
        out.resize_(100)  # 400 bytes
        assert mem.snapshot() == snap(activation=400)
    del out, del_me


def test_free_on_another_thread_is_counted(mechanism):
    with MemoryTracker(mechanism=mechanism) as mem:
        holder = [torch.randn(500)]  # 2000 bytes
        assert mem.snapshot()["activation"] == 2000
        th = threading.Thread(target=holder.clear)
        th.start()
        th.join()
        assert mem.snapshot() == ZERO


def test_registered_training_step_categories_match_costmodel(mechanism):
    """One fp32 Adam step of TinyGPT: param/grad/optim equal 4/4/8 bytes per parameter."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(), seed=0)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = synthetic_batch("tokens", 4)
    with MemoryTracker(mechanism=mechanism) as mem:
        mem.register_module(model)
        mem.register_optimizer(opt)
        assert mem.snapshot() == snap(param=4 * n)
        loss = model(x, y)
        assert mem.snapshot()["activation"] > 0
        loss.backward()
        del loss
        s = mem.snapshot()
        assert (s["grad"], s["activation"]) == (4 * n, 0)
        opt.step()
        s = mem.snapshot()
        want = costmodel.model_state_bytes(n, optimizer="adam", precision="fp32")
        assert (s["param"], s["grad"], s["optim"]) == (want["param"], want["grad"], want["optim"])
        n_tensors = len(list(model.parameters()))
        assert s["other"] == 4 * n_tensors, "Adam's 0-d fp32 step counters are 'other'"
        opt.zero_grad(set_to_none=True)
        assert mem.snapshot()["grad"] == 0
        assert sum(mem.peak().values()) > 16 * n  # activations/temporaries on top of states
    mem.remove_hooks()


def test_tied_weights_count_once(mechanism):
    cfg = GPTConfig(tie_weights=True)
    model = build_model(cfg, 0)
    untied = build_model(GPTConfig(tie_weights=False), 0)
    with MemoryTracker(mechanism=mechanism) as mem:
        mem.register_module(model)
        assert mem.snapshot()["param"] == count_bytes(model)
    assert count_bytes(untied) - count_bytes(model) == cfg.vocab * cfg.d_model * 4


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_meta_model_state_matches_costmodel(optimizer, precision):
    model = build_model(GPTConfig(vocab=50, d_model=24, n_heads=3, n_layers=3), 0)
    n = sum(p.numel() for p in model.parameters())
    got = model_state_bytes_measured(model, optimizer, precision)
    assert got == costmodel.model_state_bytes(n, optimizer=optimizer, precision=precision)
    assert all(p.device.type == "cpu" for p in model.parameters()), "the user's model is left alone"


def test_meta_7b_model_counts_without_allocating():
    cfg = GPTConfig(vocab=32000, seq_len=4096, d_model=4096, n_heads=32, n_layers=32, tie_weights=False)
    got = model_state_bytes_measured(lambda: TinyGPT(cfg), "adam", "mixed")
    n = got["param"] // 2
    assert 6.5e9 < n < 7.0e9
    assert got == costmodel.model_state_bytes(n)  # 16 bytes/param: ~108 GB
    assert got["total"] == 16 * n


def test_frozen_parameter_has_no_grad_or_state():
    model = build_model(MLPConfig(in_dim=5, hidden=7, out_dim=3, depth=2), 0)
    model.layers[0].weight.requires_grad_(False)
    frozen = model.layers[0].weight.numel()
    n = sum(p.numel() for p in model.parameters())
    got = model_state_bytes_measured(model, "adam", "fp32")
    assert got == {"param": 4 * n, "grad": 4 * (n - frozen), "optim": 8 * (n - frozen),
                   "total": 16 * n - 12 * frozen}  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16"])
def test_measured_real_step_matches_costmodel(precision):
    model = build_model(GPTConfig(), 0)
    n = sum(p.numel() for p in model.parameters())
    got = measure_model_state(model, synthetic_batch("tokens", 2), "adam", precision)
    want = costmodel.model_state_bytes(n, optimizer="adam", precision=precision)
    assert (got["param"], got["grad"], got["optim"]) == (want["param"], want["grad"], want["optim"])
    assert got["activation"] == 0 and got["peak"] > got["total"]


def test_attach_hooks_samples_forward_backward_and_step():
    model = build_model(MLPConfig(), 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    with MemoryTracker() as mem:
        rec.memory = mem
        handles = attach_hooks(model, rec, opt)
        x, y = synthetic_batch("regression", 4)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    labels = [s["label"] for s in rec.samples]
    assert labels[:3] == ["fwd:layers.0", "fwd:layers.1", "fwd:head"]
    assert labels[3:] == ["bwd:head", "bwd:layers.1", "bwd:layers.0", "optimizer.step"]
    assert all(set(s["bytes"]) == set(CATEGORIES) for s in rec.samples)
    for h in handles:
        h.remove()


def test_bad_input():
    mem = MemoryTracker()
    with pytest.raises(ValueError, match="category"):
        with mem.category("weights"):
            pass
    with pytest.raises(ValueError, match="category"):
        mem.register(torch.ones(1), "weights")
    with pytest.raises(TypeError, match="tensor"):
        mem.register([1, 2], "param")
    with pytest.raises(TypeError, match="module"):
        mem.register_module(torch.ones(1))
    with pytest.raises(TypeError, match="optimizer"):
        mem.register_optimizer("adam")
    with pytest.raises(ValueError, match="optimizer_name"):
        model_state_bytes_measured(build_model(MLPConfig(), 0), "lion", "fp32")
    with pytest.raises(ValueError, match="precision"):
        model_state_bytes_measured(build_model(MLPConfig(), 0), "adam", "fp8")
    with pytest.raises(TypeError, match="model"):
        model_state_bytes_measured(42, "adam", "fp32")
    with pytest.raises(ValueError, match="tracker"):
        attach_hooks(build_model(MLPConfig(), 0), Recorder())
    mem.start()
    with pytest.raises(RuntimeError, match="twice"):
        mem.start()
    mem.stop()


def _rank_step(ctx):
    """A training step on each rank with a labelled comm buffer and a gradient all-reduce."""
    model = build_model(GPTConfig(), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.memory.register_module(model)
    ctx.memory.register_optimizer(opt)
    x, y = synthetic_batch("tokens", 2, seed=ctx.seed + ctx.rank)
    with ctx.span("forward"):
        loss = model(x, y)
    with ctx.span("backward"):
        loss.backward()
        del loss
    with ctx.span("allreduce", kind="comm"):
        with ctx.memory.category("comm"):
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # (n,)
        dist.all_reduce(flat)  # c10d op: returns its input, nothing new allocated
    after_comm = ctx.memory.snapshot()
    del flat
    with ctx.span("step", kind="optimizer"):
        opt.step()
    # gloo's worker thread holds the buffer until it drops its handle of the finished work,
    # which may come after our `del` on a busy machine: the free counts when it happens.
    deadline = time.monotonic() + 10
    while ctx.memory.snapshot()["comm"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return after_comm, sum(p.numel() for p in model.parameters()), ctx.memory.snapshot()["comm"]


def test_launch_track_memory_two_ranks():
    res = pl.launch(_rank_step, 2, track_memory=True, timeout=60)
    for rank, (after_comm, n, comm_later) in enumerate(res.values):
        assert after_comm["comm"] == 4 * n, f"rank {rank}: the flat buffer is the only comm bytes"
        assert comm_later == 0, f"rank {rank}: the flat buffer's free was never counted"
        last = [s for s in res.memory if s["rank"] == rank and s["label"] == "step:end"][0]["bytes"]
        want = costmodel.model_state_bytes(n, optimizer="adam", precision="fp32")
        assert (last["param"], last["grad"], last["optim"]) == (
            want["param"], want["grad"], want["optim"]), f"rank {rank}: {last}"  # fmt: skip
    end = [s for s in res.memory if s["label"] == "end"]
    assert len(end) == 2 and all(s["bytes"]["param"] == 0 for s in end), "model freed when fn returned"


# -- the lesson 02 exercise check (more in tests/test_exercises_02.py) ---------------------------
def _right_calculator(num_params, optimizer, precision):
    """Written like a learner's (the lab's own accounting is switched off while the check runs)."""
    states = {"adagrad": 1, "rmsprop": 1, "rmsprop_momentum": 2, "rmsprop_centered": 3, "adam_amsgrad": 3,
              "adadelta": 2}[optimizer]  # fmt: skip
    weight, optim = {"fp32": (4, 4 * states), "mixed": (2, 4 + 4 * states), "bf16": (2, 2 * states)}[
        precision
    ]
    out = {"param": weight * num_params, "grad": weight * num_params, "optim": optim * num_params}
    return {**out, "total": sum(out.values())}


def test_check_memory_calculator_passes_a_right_answer(capsys):
    from parallel_lab.grading import check_memory_calculator

    check_memory_calculator(_right_calculator)
    out = capsys.readouterr()
    assert out.out == (
        "check_memory_calculator passed: 6 optimizers x 3 precisions, exact against real steps, "
        "at 5 sizes (2 drawn this run)\n"
    )
    assert out.err == ""


def test_check_memory_calculator_rejects_wrong_answers():
    from parallel_lab.grading.checks.memory import check_memory_calculator

    def no_master(n, optimizer, precision):  # forgets the fp32 master copy in mixed precision
        d = _right_calculator(n, optimizer, precision)
        if precision == "mixed":
            d["optim"] -= 4 * n
            d["total"] -= 4 * n
        return d

    with pytest.raises(AssertionError, match=r"precision=.mixed.\): optim is .* fewer .* fp32 master copy"):
        check_memory_calculator(no_master)

    def bad_total(n, optimizer, precision):
        return {**_right_calculator(n, optimizer, precision), "total": 0}

    with pytest.raises(AssertionError, match="total .* is not param \\+ grad \\+ optim"):
        check_memory_calculator(bad_total)
    with pytest.raises(AssertionError, match="missing"):
        check_memory_calculator(lambda n, o, p: {"param": 0})

    def stub(n, optimizer, precision):
        raise NotImplementedError("write the calculator")

    with pytest.raises(NotImplementedError):
        check_memory_calculator(stub)
    with pytest.raises(TypeError):
        check_memory_calculator("not a function")


def test_only_the_trackers_device_is_counted():
    with MemoryTracker("meta") as mem:
        torch.empty(10)  # a CPU temporary: not this tracker's device
        m = torch.empty(8, device="meta")  # 32 bytes on meta
        cpu = mem.register(torch.ones(4), "other")  # explicit registration counts anyway
        assert mem.snapshot() == snap(activation=32, other=16)
    del m, cpu


def test_a_tracker_watching_a_device_the_work_is_not_on_says_so():
    """A tracker on cuda:0 around a rank whose tensors were made on the CPU reads 0 everywhere:
    it warns at stop instead of reporting "no memory" (faked here with the meta device)."""
    with pytest.warns(RuntimeWarning, match=r"MemoryTracker\(meta\) saw no storage on meta, but \d+ on cpu"):
        with MemoryTracker("meta", mechanism="dispatch") as mem:
            torch.ones(64) * 2  # the work, on the CPU
    assert sum(mem.peak().values()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # work on the tracked device: no warning
        with MemoryTracker("meta", mechanism="dispatch"):
            torch.empty(8, device="meta") * 2


def test_cross_check_is_none_without_a_device_allocator():
    # On CUDA it compares the tracked total with the caching allocator's count; a CPU
    # run has no such count to compare with.
    with MemoryTracker() as mem:
        assert mem.cross_check() is None


def test_category_labels_are_per_thread():
    """A comm thread inside category("comm") must not relabel the main thread's allocations."""
    import threading

    mem = MemoryTracker(torch.device("cpu")).start()
    entered, release = threading.Event(), threading.Event()

    def comm_thread():
        with mem.category("comm"):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=comm_thread)
    t.start()
    entered.wait(10)
    with torch.no_grad():
        x = torch.ones(1000)  # noqa: F841 - allocated on the main thread while the label is held elsewhere
    release.set()
    t.join()
    snap = mem.snapshot()
    mem.stop()
    assert snap["comm"] == 0 and snap["other"] == 4000


def test_cuda_samples_carry_the_allocator_count(monkeypatch):
    """On CUDA a memory sample holds the caching allocator's count beside the categories
    (emulated here: the device-stats call is the only CUDA-specific piece)."""
    from parallel_lab.runtime import device as dev
    from parallel_lab.runtime.trace import Recorder

    stats = {"allocated": 10_000, "max_allocated": 12_000, "reserved": 20_000}
    monkeypatch.setattr(dev, "device_memory_stats", lambda device: dict(stats))
    with MemoryTracker("cpu") as mem:
        x = torch.ones(256)  # 1 KiB the tracker sees
        rec = Recorder(rank=0)
        s = mem.sample(rec, "after x")
    assert s["device"] == {**stats, "tracked": x.numel() * 4, "untracked": 10_000 - 1024}


def test_a_sample_carries_the_high_water_since_the_sample_before():
    """A temporary that lives and dies between two samples is not in either snapshot, but the
    second sample's high water holds it, and the memory plot's peak is that high water."""
    from parallel_lab.plots import plot_memory
    from parallel_lab.runtime.trace import Recorder

    rec = Recorder(rank=0)
    with MemoryTracker("cpu") as mem:
        keep = torch.ones(256)  # 1 KiB, lives on
        first = mem.sample(rec, "a")
        tmp = torch.ones(1024)  # 4 KiB, freed before the next sample
        del tmp
        second = mem.sample(rec, "b")
        third = mem.sample(rec, "c")
    assert sum(second["bytes"].values()) == keep.numel() * 4
    assert second["high_water"] == (256 + 1024) * 4
    assert third["high_water"] == 256 * 4  # a new window starts at every sample
    assert first["high_water"] >= 1024
    fig = plot_memory([first, second, third], unit="B")
    assert fig.axes[0].get_title() == "rank 0: peak 5.12e+03 B"


# -- the two mechanisms: the allocator hook (CPU) against the dispatch mode ----------------
def _gpt_step_snapshots(mechanism: str) -> tuple[list[dict[str, int]], int, float]:
    """Snapshots at five points of two Adam steps of TinyGPT, the peak, and the seconds spent."""
    import time

    model = build_model(GPTConfig(), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = synthetic_batch("tokens", 4)
    out = []
    with MemoryTracker(mechanism=mechanism) as mem:
        mem.register_module(model)
        mem.register_optimizer(opt)
        t = time.perf_counter()
        for _ in range(2):
            loss = model(x, y)
            out.append(mem.snapshot())  # activations held for backward
            loss.backward()
            del loss
            out.append(mem.snapshot())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(mem.snapshot())
        seconds = time.perf_counter() - t
        peak = sum(mem.peak().values())
    return out, peak, seconds


def test_allocator_and_dispatch_count_the_same_live_bytes():
    """A real training step: the categories agree between ops, except for the few bytes of
    storages no op returns (0-d tensors autograd wraps numbers in and saves), which only the
    allocator sees; its peak adds the scratch an op makes and frees inside itself."""
    hooked, hook_peak, _ = _gpt_step_snapshots("allocator")
    dispatched, disp_peak, _ = _gpt_step_snapshots("dispatch")
    for h, d in zip(hooked, dispatched):
        assert {k: v for k, v in h.items() if k != "activation"} == {
            k: v for k, v in d.items() if k != "activation"}  # fmt: skip
        assert 0 <= h["activation"] - d["activation"] <= 64, (h, d)
    assert hooked[0]["activation"] > 0 and hooked[1]["grad"] > 0 and hooked[-1]["optim"] > 0
    assert disp_peak <= hook_peak <= 1.05 * disp_peak, (hook_peak, disp_peak)


def test_mechanism_choice_and_bad_input():
    assert MemoryTracker().mechanism == "allocator"  # CPU, and this machine has a compiler
    assert MemoryTracker(mechanism="dispatch").mechanism == "dispatch"
    assert MemoryTracker("meta").mechanism == "dispatch"  # the hook wraps the CPU allocator only
    with pytest.raises(ValueError, match="mechanism must be one of"):
        MemoryTracker(mechanism="profiler")
    with pytest.raises(RuntimeError, match="mechanism='allocator' needs a CPU tracker"):
        MemoryTracker("meta", mechanism="allocator")


def test_two_hooked_trackers_count_independently():
    a = MemoryTracker().start()
    x = torch.ones(100)  # 400 bytes, only a sees it
    b = MemoryTracker().start()
    y = torch.ones(50)  # 200 bytes, both
    a.stop()
    z = torch.ones(25)  # 100 bytes, only b (a is stopped)
    assert (a.snapshot()["activation"], b.snapshot()["activation"]) == (600, 300)
    del x, y
    assert (a.snapshot()["activation"], b.snapshot()["activation"]) == (0, 100), "frees count after stop"
    b.stop()
    del z, a
    gc.collect()
    w = torch.ones(10)  # no tracker active: the hook only forwards
    assert b.snapshot() == ZERO and w.sum().item() == 10


def test_a_registered_storage_made_before_start_is_heard_dying(mechanism):
    p = torch.ones(64)  # 256 bytes, made before the tracker
    with MemoryTracker(mechanism=mechanism) as mem:
        mem.register(p, "param")
        mem.register(p, "param")  # registering twice counts once
        assert mem.snapshot() == snap(param=256)
        del p
        gc.collect()
        assert mem.snapshot() == ZERO


@pytest.mark.parametrize("inner", ["allocator", "dispatch", None])
def test_exclusive_blinds_every_other_tracker(mechanism, inner):
    """Offload's emulated host: inside `exclusive(host)` the device tracker sees nothing."""
    from parallel_lab.runtime.memory import exclusive

    with MemoryTracker(mechanism=mechanism) as device:
        host = MemoryTracker(mechanism=inner) if inner else None
        a = torch.ones(100)  # 400 bytes, device
        with exclusive(host):
            if host is not None:
                host.start()
            h = torch.ones(30)  # 120 bytes, host only
            del a  # a device free inside the section still counts
            if host is not None:
                host.stop()
        d = torch.ones(10)  # 40 bytes, device again
        assert device.snapshot() == snap(activation=40)
        if host is not None:
            assert host.snapshot() == snap(activation=120)
    del h, d
