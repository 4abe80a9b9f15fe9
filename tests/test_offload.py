"""ZeRO-Offload and weight streaming: parity, bytes on each side of the (emulated) boundary, the budget.

Tolerances as in test_zero.py: offloading changes where Adam runs, not its arithmetic, so
ZeroOffload must equal ZeRO-2 bit for bit and single-process Adam within 5e-5 (fp32
reassociation amplified by Adam, see test_zero's docstring); streaming copies weights
exactly, so its output is bit-exact.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from test_zero import BATCH, LR, STEPS, TOL_PARAM, make

from parallel_lab import launch
from parallel_lab.comms import ring_bytes_per_rank
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.offload import ZeroOffload, offload_state_bytes
from parallel_lab.offload.streaming import WeightStreamer, streaming_units
from parallel_lab.scripts.zero import full_params
from parallel_lab.zero import ZeRO


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- parity
def _parity(ctx) -> tuple[list[str], dict]:
    n, r = ctx.world_size, ctx.rank
    bad, finals = [], {}
    for kind in ("gpt", "tied"):
        ref, vocab = make(kind)
        ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR)
        x, y = synthetic_batch("tokens", BATCH, seq_len=8, vocab=vocab, seed=1)
        b = BATCH // n
        xs, ys = x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]
        ours, _ = make(kind)
        z = ZeroOffload(ctx, ours, optimizer="adam", lr=LR)
        twin, _ = make(kind)
        z2 = ZeRO(ctx, twin, stage=2, lr=LR)
        for step in range(STEPS):
            ropt.zero_grad()
            ref(x, y).backward()
            ropt.step()
            for model, zz in ((ours, z), (twin, z2)):
                model(xs, ys).backward()
                zz.step()
                zz.zero_grad()
            got, want = full_params(z), dict(ref.named_parameters(remove_duplicate=False))
            d = max((got[k] - v).abs().max().item() for k, v in want.items())
            if d > TOL_PARAM or (n == 1 and d != 0):
                bad.append(
                    f"{kind}, {n} ranks, rank {r}, step {step}: offload differs from one process by {d:.3g}"
                )
            same = all(torch.equal(got[k], v) for k, v in full_params(z2).items())
            if not same:
                bad.append(f"{kind}, {n} ranks, rank {r}, step {step}: offload differs from ZeRO-2")
        finals[kind] = np.concatenate([v.reshape(-1).numpy() for v in full_params(z).values()])
    return bad, finals


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_offload_equals_single_process_and_zero2(n):
    res = launch(_parity, n, timeout=240)
    assert [b for v in res.values for b in v[0]] == []
    for kind, first in res.values[0][1].items():
        assert all(np.array_equal(v[1][kind], first) for v in res.values), f"{kind}: ranks differ"


def _vs_fsdp2_offload(ctx) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    b = BATCH // ctx.world_size
    x, y = synthetic_batch("tokens", BATCH, seq_len=8, vocab=37, seed=1)
    xs, ys = x[ctx.rank * b : (ctx.rank + 1) * b], y[ctx.rank * b : (ctx.rank + 1) * b]
    ours, _ = make("gpt")
    z = ZeroOffload(ctx, ours, lr=LR)
    theirs, _ = make("gpt")
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    policy = CPUOffloadPolicy(pin_memory=False)  # no accelerator here to pin for
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(theirs, mesh=mesh, offload_policy=policy)
    opt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=LR)
    for _ in range(STEPS):
        ours(xs, ys).backward()
        z.step()
        z.zero_grad()
        theirs(xs, ys).backward()
        opt.step()
        opt.zero_grad()
    got = full_params(z)
    return max((got[k] - v.full_tensor()).abs().max().item() for k, v in theirs.state_dict().items())


def test_offload_matches_fsdp2_cpu_offload():
    assert max(launch(_vs_fsdp2_offload, 2, timeout=240).values) <= TOL_PARAM


# ----------------------------------------------------------------------------- bytes on each side
def _sides(ctx, precision: str) -> dict:
    gc.collect()
    model = build_model(GPTConfig(vocab=35, seq_len=8, d_model=16, n_heads=2, n_layers=2), seed=0)
    z = ZeroOffload(ctx, model, lr=LR, precision=precision)
    x, y = synthetic_batch("tokens", 2, seq_len=8, vocab=35, seed=ctx.rank)
    ctx.recorder.reset()
    for _ in range(2):
        model(x, y).backward()
        z.step()
        z.zero_grad()
    memcpy = {}
    for e in ctx.recorder.events:
        if e["kind"] == "memcpy":
            key = e["name"].split()[0]
            memcpy[key] = memcpy.get(key, 0) + e["args"]["bytes"]
    return {"device": ctx.memory.snapshot(), "host": z.host.tracker.snapshot(), "counted": z.state_bytes(),
            "numel": z.layout.numel, "shard": z.layout.shard, "padded": z.layout.padded,
            "transfer": dict(z.transfer_bytes), "memcpy": memcpy, "comm": ctx.recorder.comm_totals(),
            "host_samples": len(z.host.samples)}  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_device_and_host_bytes_transfers_and_comm(precision):
    res = launch(_sides, 3, precision, track_memory=True, timeout=240)
    item = 4 if precision == "fp32" else 2
    for r, v in enumerate(res.values):
        want = offload_state_bytes(v["numel"], 3, precision)
        dev, host = v["device"], v["host"]
        assert v["padded"] > v["numel"]  # Ψ = 7,280 is not a multiple of 3: padding
        assert (dev["param"], dev["grad"], dev["optim"]) == (want["device"]["param"], 0, 0), dev
        assert (host["grad"], host["optim"]) == (want["host"]["grad"], want["host"]["optim"]), host
        assert host["activation"] == 0 and dev["activation"] <= 1024  # only the loss scalars remain
        assert {k: v["counted"][k] for k in ("device", "host")} == want
        per_step = v["shard"] * item  # S elements each way, in the working dtype
        assert v["transfer"] == {"d2h": 2 * per_step, "h2d": 2 * per_step}
        assert v["memcpy"] == {"D2H": 2 * per_step, "H2D": 2 * per_step}
        ring = ring_bytes_per_rank(v["padded"], 3, item, "all_reduce")[r]  # ZeRO-2's volume, unchanged
        assert (v["comm"]["sent"], v["comm"]["recv"]) == (2 * ring[0], 2 * ring[1])
        assert v["host_samples"] > 4


def _changed(ctx) -> list[str]:
    out = []
    for case in ("optimizer", "precision", "replaced"):
        try:
            model = make("tied")[0]
            if case == "optimizer":
                ZeroOffload(ctx, model, optimizer="rmsprop")
            elif case == "precision":
                ZeroOffload(ctx, model, precision="fp8")
            else:
                z = ZeroOffload(ctx, model)
                model.layers[0].weight = torch.nn.Parameter(torch.zeros(7, 7))
                z.step()
            out.append(f"{case}: no error")
        except ValueError as e:
            out.append(f"{case}: {e}")
    return out


def test_offload_bad_input():
    got = launch(_changed, 1).values[0]
    assert "optimizer must be one of" in got[0] and "precision must be one of" in got[1], got
    assert got[2].startswith("replaced: model:") and "'layers.0.weight' is a new Parameter" in got[2], got


# ----------------------------------------------------------------------------- streaming inference
CFG = GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=4, n_layers=6)


def _stream(ctx, budget: int, reserve: int, prefetch: bool, batch: int = 2) -> dict:
    ref = build_model(CFG, seed=0)
    x, _ = synthetic_batch("tokens", batch, seq_len=16, vocab=64, seed=0)
    with torch.no_grad():
        want = ref(x)
    del ref
    gc.collect()
    model = build_model(CFG, seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    s = WeightStreamer(ctx, model, budget, prefetch=prefetch, reserve_bytes=reserve)
    ctx.memory.reset_peak()
    ctx.recorder.reset()
    with torch.no_grad():
        got = model(x)
    loads = [e["args"]["bytes"] for e in ctx.recorder.events if e["kind"] == "memcpy"]
    return {"exact": torch.equal(got, want), "weights": weights, "peak": sum(ctx.memory.peak().values()),
            "h2d": s.h2d_bytes, "loads": loads, "sizes": s.sizes, "host": s.host.tracker.snapshot()["param"],
            "device_after": ctx.memory.snapshot()["param"], "names": [type(u).__name__ for u in s.units]}  # fmt: skip


@pytest.mark.parametrize("budget, prefetch", [(340_000, True), (620_000, True), (340_000, False)])
def test_streaming_runs_a_model_larger_than_the_budget(budget, prefetch):
    v = launch(_stream, 1, budget, 120_000, prefetch, track_memory=True).values[0]
    assert v["exact"]
    assert v["weights"] > 1.9 * budget  # the model does not fit
    assert v["peak"] <= budget, (v["peak"], budget)  # measured: never over the budget
    block = max(v["sizes"])
    assert v["peak"] > block  # at least one block was on the device
    if budget > 3 * block:  # room for two blocks and the reserve: the next block was prefetched
        assert v["peak"] > 2 * block
    # every unit's weights crossed once per forward; the tied embedding/head twice
    assert v["h2d"] == sum(v["sizes"]) == sum(v["loads"]) == v["weights"] + 64 * 64 * 4
    assert v["host"] == v["weights"] and v["device_after"] == 0
    assert v["names"][:2] == ["Embedding", "Embedding"] and v["names"][-2:] == ["LayerNorm", "Linear"]


def _stream_errors(ctx) -> list[str]:
    out = []
    cases = {
        "small budget": lambda m: WeightStreamer(ctx, m, 100_000),
        "bad budget": lambda m: WeightStreamer(ctx, m, 0),
        "bad reserve": lambda m: WeightStreamer(ctx, m, 10**7, reserve_bytes=-1),
        "grad mode": lambda m: (WeightStreamer(ctx, m, 10**7), m(synthetic_batch("tokens", 1, seq_len=16, vocab=64)[0])),
        "activations": lambda m: (
            WeightStreamer(ctx, m, 240_000, reserve_bytes=0),
            torch.no_grad().__enter__(),
            m(synthetic_batch("tokens", 64, seq_len=16, vocab=64)[0]),
        ),
    }  # fmt: skip
    for name, fn in cases.items():
        try:
            fn(build_model(CFG, seed=0))
            out.append(f"{name}: no error")
        except (ValueError, RuntimeError) as e:
            out.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            torch.set_grad_enabled(True)
    return out


def test_streaming_bad_input_and_an_exceeded_budget():
    got = launch(_stream_errors, 1, track_memory=True).values[0]
    assert "ValueError: budget_bytes=100,000 is too small" in got[0], got
    assert "ValueError: budget_bytes must be a positive int" in got[1], got
    assert "ValueError: reserve_bytes must be an int >= 0" in got[2], got
    assert "RuntimeError: WeightStreamer runs inference only" in got[3], got
    assert "RuntimeError: device budget exceeded" in got[4], got


def test_streaming_units_follow_the_forward_order():
    model = build_model(CFG, seed=0)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(u)] for u in streaming_units(model)] == [
        "wte", "wpe", *[f"blocks.{i}" for i in range(6)], "ln_f", "lm_head"
    ]  # fmt: skip
