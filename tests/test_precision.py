"""Mixed precision: the loss-scale rule against torch's own kernel, LossScaler against
torch.amp.GradScaler end to end, every rank skipping together, master weights, memory per dtype.

Tolerances: a data-parallel fp16 run sums its gradients in another order than one
process on the whole batch (each rank reduces its rows in fp16, then the ranks'
fp32 averages are summed), so gradients and weights agree to fp16's resolution,
not bit for bit; the scale history and the skipped steps agree exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel_lab import RunResult, launch
from parallel_lab.costmodel import model_state_bytes
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.precision import (
    LossScaler,
    MixedPrecisionConfig,
    MixedPrecisionOptimizer,
    apply_updates,
    classify,
    format_table,
    has_overflow,
    resolve_dtype,
    update_scale,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread is fastest here, and ranks forked from this process then never inherit a
    busy OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


REPO = Path(__file__).resolve().parents[1]


def _np(x):
    """Results leave the ranks as numpy arrays: a tensor returned by a rank travels as a shared-memory
    file descriptor that can vanish with the exiting rank (ConnectionResetError in the parent)."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_np(v) for v in x]
    return x


def _t(x):
    return None if x is None else torch.from_numpy(x)


CFG = GPTConfig(vocab=40, seq_len=8, d_model=24, n_heads=2, n_layers=2)  # tied weights (default)
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
# Every launch here runs its ranks on one thread each: a rank forked from a process that already ran
# OpenMP-parallel ops (the autocast tests below) hangs in its first parallel op when given 2 threads.


# ----------------------------------------------------------------------------- numbers (no ranks)
def test_formats_and_seed_underflow():
    fp16 = {r["dtype"]: r for r in format_table()}["fp16"]
    assert (fp16["exponent_bits"], fp16["mantissa_bits"]) == (5, 10)
    assert fp16["smallest_normal"] == 2.0**-14  # 6.1e-5: the usual "~6e-5"
    assert fp16["smallest_subnormal"] == 2.0**-24 and fp16["max"] == 65504.0
    assert classify(1e-4) == "normal" and classify(5e-5) == "subnormal" and classify(2e-8) == "zero"
    assert classify(7e4) == "inf" and classify(1e-30, "bf16") == "normal"
    # lr 1e-4 x grad 0.5: each update is half a unit in the last place of 1.0 or less: lost in fp16
    res = apply_updates(1.0, 5e-5, 1000)
    assert res["naive"] == 1.0
    assert abs(res["master"] - 0.95) < 1e-3  # the fp32 master copy kept every step


def test_update_rule_matches_torch_kernel():
    """`update_scale` against `torch._amp_update_scale_`, the kernel GradScaler.update runs."""
    import random

    rng = random.Random(0)
    for init, growth, backoff, interval in [(2.0**16, 2.0, 0.5, 3), (1.0, 3.0, 0.25, 1), (2.0**126, 2.0, 0.5, 2),
                                            (7.0, 1.5, 0.3, 5)]:  # fmt: skip
        scale = torch.full((), init, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        ours = (LossScaler(init, growth, backoff, interval).get_scale(), 0)
        for i in range(200):
            found = rng.random() < 0.2
            torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), growth, backoff, interval)
            ours = update_scale(*ours, found, growth, backoff, interval)
            assert ours == (scale.item(), tracker.item()), (
                f"step {i}: ours {ours}, torch {scale.item(), tracker.item()}"
            )


def _train_autocast(scaler, steps: int, inject: tuple[int, ...]):
    """fp32 weights, fp16 autocast compute, `scaler` in GradScaler's calling convention."""
    model = build_model(CFG, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scales, skipped = [], []
    for s in range(steps):
        x, y = synthetic_batch("tokens", BATCH, seq_len=CFG.seq_len, vocab=CFG.vocab, seed=s)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)  # (B, T, V) fp16
        loss = F.cross_entropy(logits.float().view(-1, CFG.vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        if s in inject:
            model.wte.weight.grad.view(-1)[3] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return scales, skipped, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("init,interval", [(2.0**24, 4), (2.0**16, 2)])
def test_loss_scaler_equals_grad_scaler(init, interval):
    """Same init scale, growth, backoff and interval, same model and data, natural overflows plus planted
    NaNs: the same scale history, the same skipped steps, and bit-identical weights."""
    inject = (9, 10, 15)
    theirs = _train_autocast(
        torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval), 18, inject
    )
    ours = _train_autocast(LossScaler(init, growth_interval=interval), 18, inject)
    assert ours[0] == theirs[0], f"scale history differs:\nours  {ours[0]}\ntorch {theirs[0]}"
    assert ours[1] == theirs[1]
    assert all(ours[1][s] for s in inject)
    assert sum(ours[1]) > len(inject), "no natural overflow happened: the test lost its point"
    for a, b in zip(ours[2], theirs[2]):
        assert torch.equal(a, b)


def test_bad_input():
    for kw, match in [({"init_scale": 0}, "init_scale"), ({"growth_factor": 1.0}, "growth_factor"),
                      ({"backoff_factor": 1.5}, "backoff_factor"), ({"growth_interval": 0}, "growth_interval"),
                      ({"init_scale": float("inf")}, "init_scale"), ({"growth_interval": 2.5}, "growth_interval")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            LossScaler(**kw)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        MixedPrecisionConfig(dtype="int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype(torch.float64)
    with pytest.raises(ValueError, match="loss_scale"):
        MixedPrecisionConfig(loss_scale=-1.0)
    with pytest.raises(RuntimeError, match="update"):
        LossScaler().update()
    assert has_overflow([torch.ones(2), torch.tensor([1.0, float("inf")])]) and not has_overflow([None])


# ----------------------------------------------------------------------------- ranks
def _dp_run(ctx, dtype: str, steps: int, inject: tuple[int, ...], init: float, interval: int, bad_rank: int):
    """Each rank trains on its rows; returns per step: local overflow, skipped, scale, logits of its rows,
    the averaged fp32 gradients the optimizer saw, and the master weights after the step."""
    torch.set_num_threads(1)
    model = build_model(CFG, seed=0)
    model.wpe.weight.requires_grad_(False)  # a frozen parameter: no master, no gradient, still 16-bit
    cfg = MixedPrecisionConfig(dtype=dtype, init_scale=init, growth_interval=interval,
                               loss_scale="dynamic" if dtype == "fp16" else "none")  # fmt: skip
    # SGD: the update is linear in the gradient, so gradient rounding differences stay small in the
    # weights (Adam divides by sqrt(v) and turns a tiny gradient difference into a full lr step).
    opt = MixedPrecisionOptimizer(model, "sgd", 0.5, cfg, ctx=ctx if ctx.world_size > 1 else None)
    seen: list = []
    opt.optimizer.register_step_pre_hook(
        lambda o, a, k: seen.append(
            torch.cat([p.grad.float().reshape(-1) for p in (opt.masters or opt.params)])
        )
    )
    per = BATCH // ctx.world_size
    rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
    out = []
    for s in range(steps):
        x, y = synthetic_batch("tokens", BATCH, seq_len=CFG.seq_len, vocab=CFG.vocab, seed=s)
        x, y = x[rows], y[rows]
        opt.zero_grad()
        logits = model(x)  # (B/N, T, V)
        loss = F.cross_entropy(logits.float().view(-1, CFG.vocab), y.reshape(-1))
        opt.backward(loss)
        if s in inject and dtype == "fp16" and ctx.rank == bad_rank % ctx.world_size:
            opt.params[1].grad.view(-1)[0] = float("inf")
        local = has_overflow(p.grad for p in opt.params)
        n_seen = len(seen)
        scale = opt.scaler.get_scale()
        ran = opt.step()
        out.append({
            "local_inf": local, "skipped": not ran, "scale": scale, "logits": logits.detach().float(),
            "grad": seen[-1] if len(seen) > n_seen else None,
            "master": torch.cat([p.detach().float().reshape(-1) for p in (opt.masters or opt.params)]),
            "weights16": torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]),
        })  # fmt: skip
    return _np(out)


# Measured worst cases over these 6 steps: fp16 gradients 2.7e-3 of the largest, masters 2.1e-4;
# bf16 (8 significant bits) 7.1e-3 and 1.3e-3. Bounds are ~4x that.
@pytest.mark.parametrize("dtype,grad_rtol,atol", [("fp16", 1e-2, 1e-3), ("bf16", 3e-2, 5e-3)])
def test_data_parallel_matches_single_process(dtype, grad_rtol, atol):
    """3 ranks, rank 1 alone overflows at steps 2 and 4 (fp16): all ranks skip them, keep one scale history,
    and track a single process trained on the whole batch (same planted overflows) step by step.
    bf16 runs without a scaler and never skips."""
    steps, inject = 6, (2, 4)
    args = (dtype, steps, inject, 2.0**10, 1000, 1)  # no growth: any skip is a planted one
    ref = launch(_dp_run, 1, *args, threads=1).values[0]
    res = launch(_dp_run, 3, *args).values
    per = BATCH // 3
    for s in range(steps):
        planted = dtype == "fp16" and s in inject
        for r, v in enumerate(res):
            st = v[s]
            assert st["local_inf"] == (planted and r == 1), (
                f"step {s} rank {r}: local overflow {st['local_inf']}"
            )
            assert st["skipped"] == planted, f"step {s} rank {r}: skipped={st['skipped']}, expected {planted}"
            assert st["scale"] == ref[s]["scale"] == res[0][s]["scale"]
            # forward: rows are independent, so with the same weights (step 0) this rank's logits are the
            # reference's rows bit for bit; later the weights carry the reduction-order differences.
            lg, lref = _t(st["logits"]), _t(ref[s]["logits"])[r * per : (r + 1) * per]
            if s == 0:
                assert torch.equal(lg, lref), f"rank {r}: logits differ from the reference's rows"
            else:
                assert (lg - lref).abs().max() <= 10 * atol, (
                    f"step {s} rank {r}: logits {(lg - lref).abs().max():.3g}"
                )
            assert torch.equal(_t(st["master"]), _t(res[0][s]["master"])), "replicas drifted apart"
            if planted:
                assert st["grad"] is None  # the optimizer never ran
            else:
                # fp16 row sums in another order: agree to 16-bit resolution, relative to the largest gradient
                g, gref = _t(st["grad"]), _t(ref[s]["grad"])
                assert (g - gref).abs().max() <= grad_rtol * gref.abs().max(), f"step {s} rank {r}"
            m, mref = _t(st["master"]), _t(ref[s]["master"])
            assert torch.allclose(m, mref, atol=atol, rtol=0), (
                f"step {s} rank {r}: masters differ by {(m - mref).abs().max():.3g}"
            )
    assert [st["scale"] for st in ref] == (
        [1024.0] * 3 + [512.0] * 2 + [256.0] if dtype == "fp16" else [1.0] * 6
    )


def test_natural_overflows_agree_across_ranks():
    """Growth every 2 clean steps from 2^16: the scale keeps running into fp16's ceiling. A rank whose own
    gradients stayed finite still skips when another overflowed; weights stay identical on every rank."""
    res = launch(_dp_run, 2, "fp16", 12, (), 2.0**16, 2, 0).values
    a, b = res
    assert [s["skipped"] for s in a] == [s["skipped"] for s in b]
    assert [s["scale"] for s in a] == [s["scale"] for s in b]
    assert any(s["skipped"] for s in a)
    assert all(torch.equal(_t(x["weights16"]), _t(y["weights16"])) for x, y in zip(a, b))


def _memory(ctx, dtype: str, masters: bool):
    model = build_model(CFG, seed=0)
    cfg = MixedPrecisionConfig(dtype=dtype, master_weights=masters, loss_scale="none")
    opt = MixedPrecisionOptimizer(model, "adam", 1e-3, cfg, ctx=ctx)
    x, y = synthetic_batch("tokens", 4, seq_len=CFG.seq_len, vocab=CFG.vocab)
    opt.backward(F.cross_entropy(model(x).float().view(-1, CFG.vocab), y.reshape(-1)))
    opt.step()
    return {"n": sum(p.numel() for p in opt.params), **ctx.memory.snapshot()}


def test_memory_per_dtype_matches_cost_model():
    """Model states measured by the MemoryTracker after a step: 16 bytes/param for fp32 and for mixed fp16
    or bf16 (2 + 2 + 4 master + 8 Adam), 8 for pure bf16 (no master copy)."""
    for dtype, masters, precision in [("fp32", True, "fp32"), ("fp16", True, "mixed"), ("bf16", True, "mixed"),
                                      ("bf16", False, "bf16")]:  # fmt: skip
        v = launch(_memory, 1, dtype, masters, track_memory=True, threads=1).values[0]
        want = model_state_bytes(v["n"], precision=precision)
        got = {k: v[k] for k in ("param", "grad", "optim")}
        assert got == {k: want[k] for k in got}, (
            f"{dtype} masters={masters}: measured {got}, predicted {want}"
        )


def test_script_under_torchrun(tmp_path):
    """SLOW-ish (~10 s): two spawned processes each import torch. Rank 1 overflows at step 3; rank 0's
    trace shows one 1-element flag all-reduce per step per rank, and both ranks skipped step 3."""
    trace = tmp_path / "mp.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "parallel_lab.scripts.mixed_precision", "--steps", "6",
           "--overflow-at", "3", "--checkpoint-segments", "2", "--trace", str(trace)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped steps [3]" in out.stdout and "same scale: True; identical weights: True" in out.stdout
    res = RunResult.load(str(trace))
    assert res.world_size == 2 and res.backend == "gloo"
    flags = [e for e in res.timeline if e["name"] == "all_reduce" and e["args"].get("numel") == 1]
    assert len(flags) == 2 * 6  # one 1-element overflow flag per step per rank
    assert [v["skipped"] for v in res.values] == [[False, False, False, True, False, False]] * 2
    assert [v["local_inf"][3] for v in res.values] == [False, True]  # only the last rank overflowed
    assert any(e["name"].startswith("recompute") for e in res.timeline)  # lesson 07's checkpointing, composed
