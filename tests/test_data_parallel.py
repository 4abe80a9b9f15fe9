"""Data parallel (lesson 03): parameter server, all-reduce DP, BucketedDDP, accumulation, torch DDP.

Parity: the parent trains one seeded model on the whole batch in one process and
records every step (logits before the update, the gradients, the parameters after
it). Each world size then gets ONE launch in which every rank runs every variant on
its slice of each batch and compares, step by step, its logits with its rows of
the reference's, its synced gradients with the reference's, and its parameters with
the reference's. A rank returns a list of failure strings; the test asserts they
are all empty, so one failing case names itself.

The model is awkward on purpose: tied input/output embeddings, a frozen parameter
(the position embedding), and 1547 trainable parameters, divisible by none of 2, 3, 4.

Tolerances. The parity runs are float64: the only difference from the reference is
the order of floating-point sums (across ranks, and inside the matmuls of a smaller
batch), ~1e-16 relative per add; five Adam steps divide by sqrt(v) and can amplify
the relative error of a near-zero gradient, and the largest difference seen is
~4e-14. ATOL = 1e-12 leaves 25x margin over that, while every real bug tried (a
missing 1/N, a bucket never reduced, an accumulation step synced twice) is off by
1e-4 or more. The float32 run states its own tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from parallel_lab import comms as C
from parallel_lab import launch
from parallel_lab.costmodel import allreduce_bytes_per_rank
from parallel_lab.data_parallel import (
    AllReduceDP,
    ParametersChangedError,
    ParameterServerDP,
    check_accumulation_steps,
    loss_fn,
    shard_batch,
    train_step,
)
from parallel_lab.data_parallel.ddp import BucketedDDP, assign_buckets
from parallel_lab.models import GPTConfig, build_model, make_optimizer, synthetic_batch
from parallel_lab.runtime.overlap import LayerTimer, comm_hidden_fraction

CFG = GPTConfig(vocab=25, seq_len=8, d_model=7, n_heads=1, n_layers=2, tie_weights=True)
BATCH, STEPS, LR = 24, 5, 1e-2
ATOL = 1e-12  # float64, see the module docstring


def make_model(dtype=torch.float64) -> nn.Module:
    m = build_model(CFG, seed=0).to(dtype)
    m.wpe.weight.requires_grad_(False)  # the frozen parameter
    return m


def batches(n: int = STEPS) -> list:
    return [
        synthetic_batch("tokens", BATCH, seq_len=CFG.seq_len, vocab=CFG.vocab, seed=100 + i) for i in range(n)
    ]


def trainable_named(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in m.named_parameters() if p.requires_grad}


def reference(dtype=torch.float64) -> list[dict]:
    """Single-process Adam on the whole batch; per step: logits before the update, grads, params after."""
    m = make_model(dtype)
    opt = make_optimizer("adam", [p for p in m.parameters() if p.requires_grad], LR)
    out = []
    for x, y in batches():
        with torch.no_grad():
            logits = m(x)  # (B, T, V)
        opt.zero_grad(set_to_none=True)
        loss_fn(m, x, y).backward()
        grads = {n: p.grad.clone() for n, p in trainable_named(m).items()}
        opt.step()
        out.append(
            {
                "logits": logits,
                "grads": grads,
                "params": {n: p.detach().clone() for n, p in m.named_parameters()},
            }
        )
    return out


def bucket_bytes_for(k: int, model: nn.Module) -> int:
    """A bucket cap that gives exactly k buckets (bucket count only falls as the cap grows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    lo, hi = 1, total
    while lo <= hi:
        mid = (lo + hi) // 2
        n = len(assign_buckets(model.parameters(), mid))
        if n == k:
            return mid
        lo, hi = (mid + 1, hi) if n > k else (lo, mid - 1)
    raise AssertionError(f"no bucket cap gives {k} buckets")


# ----------------------------------------------------------------------------- no ranks needed
def test_assign_buckets_rules():
    a, b, c, d = (nn.Parameter(torch.zeros(n)) for n in (4, 2, 3, 5))  # 16, 8, 12, 20 bytes
    frozen = nn.Parameter(torch.zeros(100), requires_grad=False)
    params = [a, frozen, b, c, a, d]  # `a` repeated: a tied weight, counted at its first appearance
    ids = lambda buckets: [
        [{id(a): "a", id(b): "b", id(c): "c", id(d): "d"}[id(p)] for p in x] for x in buckets
    ]
    assert ids(assign_buckets(params, 1e9)) == [["d", "c", "b", "a"]]  # reverse order, one bucket
    assert ids(assign_buckets(params, 20)) == [["d"], ["c", "b"], ["a"]]  # closes at >= 20 bytes
    assert ids(assign_buckets(params, 21)) == [["d", "c"], ["b", "a"]]
    assert ids(assign_buckets(params, 1)) == [["d"], ["c"], ["b"], ["a"]]  # bigger than the cap: own bucket
    assert assign_buckets([frozen], 10) == []
    half = nn.Parameter(torch.zeros(3, dtype=torch.float16))  # dtypes never share a flat buffer
    assert [len(x) for x in assign_buckets([a, half, b], 1e9)] == [2, 1]  # (b, a), (half,)


@pytest.mark.parametrize(
    "bad,err",
    [(0, ValueError), (-5, ValueError), (float("nan"), ValueError), ("25MB", TypeError), (True, TypeError)],
)
def test_bucket_bytes_bad_input(bad, err):
    with pytest.raises(err, match="bucket_bytes"):
        assign_buckets([nn.Parameter(torch.zeros(2))], bad)


def test_accumulation_and_batch_bad_input():
    with pytest.raises(ValueError, match="accumulation_steps must be >= 1"):
        check_accumulation_steps(0)
    with pytest.raises(TypeError, match="accumulation_steps must be an int"):
        check_accumulation_steps(1.5)
    with pytest.raises(ValueError, match="divisible by accumulation_steps"):
        check_accumulation_steps(4, local_batch=6)
    with pytest.raises(ValueError, match="divisible by world_size"):
        shard_batch((torch.zeros(10, 2),), 0, 4)


def test_comm_hidden_fraction_arithmetic():
    ev = lambda name, kind, a, b, r=0: {"rank": r, "name": name, "kind": kind, "start": a, "end": b}
    events = [ev("bwd h", "compute", 0, 2), ev("bwd e", "compute", 2, 4), ev("bucket 0", "comm", 1, 3),
              ev("bucket 1", "comm", 3, 7), ev("bwd h", "compute", 0, 1, r=1)]  # fmt: skip
    assert comm_hidden_fraction(events, rank=0) == pytest.approx((2 + 1) / (2 + 4))
    assert math.isnan(comm_hidden_fraction(events, rank=1))


# ----------------------------------------------------------------------------- parity on ranks
def _close(fails: list, what: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if got.shape != want.shape or not diff <= atol:
        fails.append(
            f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max |diff| {diff:.3g} > {atol:g}"
        )


def _sent(ctx) -> int:
    return sum(v["sent"] for v in ctx.recorder.comm.values())


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.grad.clone() for n, q in trainable_named(model).items()}


def _run_variant(ctx, ref, name, opts, fails, out, dtype=torch.float64, atol=ATOL):
    """Train 5 steps with one variant, comparing logits, synced grads and params with `ref` at every step."""
    p, r = ctx.world_size, ctx.rank
    model = make_model(dtype)
    where = f"p={p} rank {r} {name} {opts}"
    synced = []  # the gradients the optimizer sees: captured by a step pre-hook, after the sync
    timer = LayerTimer(model, ctx)  # before wrapping, so its gradient hooks fire first
    if name == "param_server":
        dp = ParameterServerDP(model, ctx, lambda ps: make_optimizer("adam", ps, LR))
        opt = dp.optimizer
    else:
        if name == "allreduce":
            dp = AllReduceDP(model, ctx, algorithm=opts.get("algorithm", "builtin"))
        elif name == "torch_ddp":
            dp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts["bucket_bytes"] / 2**20)
        else:
            dp = BucketedDDP(model, ctx, bucket_bytes=opts["bucket_bytes"], comm=opts.get("comm", "builtin"))
            if len(dp.buckets) != opts["buckets"]:
                fails.append(f"{where}: {len(dp.buckets)} buckets, expected {opts['buckets']}")
        opt = make_optimizer("adam", [q for q in model.parameters() if q.requires_grad], LR)
    if opt is not None:
        opt.register_step_pre_hook(lambda o, a, k: synced.append(_grads(model)))
    for i, (x, y) in enumerate(batches()):
        x, y = x, y
        xs, ys = shard_batch((x, y), r, p)
        with torch.no_grad():  # forward output: our rows of the reference's logits (params before step i)
            _close(fails, f"{where} step {i} logits", model(xs), ref[i]["logits"].chunk(p)[r], atol)
        ctx.recorder.reset()
        if name == "param_server":
            dp.step((x, y) if r == 0 else None)
            dp.pull()  # the server's new weights to every rank, to compare them now
        else:
            train_step(ctx, dp, opt, (xs, ys), accumulation_steps=opts.get("k", 1), timer=timer)
        if name == "ddp" and p > 1:
            sizes = [b.buffer.numel() for b in dp.buckets]
            out.setdefault(opts.get("comm", "builtin"), []).append((sizes, _sent(ctx)))
            inside = opts.get("comm", "builtin") == "builtin"
            out.setdefault("late", []).append(_buckets_start_in_backward(ctx, len(sizes), where, inside))
        if synced:  # the server, or every rank of the other variants
            for n, g in synced.pop().items():
                _close(fails, f"{where} step {i} grad {n}", g, ref[i]["grads"][n], atol)
        for n, q in model.named_parameters():
            _close(fails, f"{where} step {i} param {n}", q.detach(), ref[i]["params"][n], atol)
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()]).tolist()  # lists travel safely


def _buckets_start_in_backward(ctx, n_buckets: int, where: str, inside: bool) -> str | None:
    """Every bucket's all-reduce is issued inside backward (from a gradient hook), once per step:
    after backward began and before `loss.backward()` returned (when train_step starts waiting).

    With comm="ring" the span starts when the comm thread gets the GIL, which may be after
    backward: only the count is checked there."""
    ev = ctx.recorder.events
    lo = min(e["start"] for e in ev if e["name"].startswith("bwd "))
    hi = min(e["start"] for e in ev if e["name"] == "wait for buckets")
    buckets = [e for e in ev if e["kind"] == "comm" and e["name"] in ("all_reduce", "ring_all_reduce")
               or e["name"].startswith("bucket")]  # fmt: skip
    if len(buckets) != n_buckets:
        return f"{where}: {len(buckets)} bucket all-reduces in one step, expected {n_buckets}"
    late = [e["name"] for e in buckets if inside and not lo <= e["start"] <= hi]
    return f"{where}: issued outside backward: {late}" if late else None


def _parity_rank(ctx, ref, ref32, caps, caps32):
    fails: list[str] = []
    out: dict = {}
    variants = [("param_server", {}), ("allreduce", {}), ("allreduce", {"algorithm": "ring"}),
                *[("ddp", {"buckets": k, "bucket_bytes": caps[k]}) for k in (1, 2, 3)],
                ("ddp", {"buckets": 3, "bucket_bytes": caps[3], "k": 2}),
                ("ddp", {"buckets": 2, "bucket_bytes": caps[2], "comm": "ring"}),
                ("torch_ddp", {"bucket_bytes": caps[2]})]  # fmt: skip
    finals = {f"{n} {o}": _run_variant(ctx, ref, n, o, fails, out) for n, o in variants}
    # float32: the same sums in a shorter mantissa; see ATOL32
    for n, o in (
        ("ddp", {"buckets": 3, "bucket_bytes": caps32[3]}),
        ("torch_ddp", {"bucket_bytes": caps32[2]}),
    ):
        finals[f"fp32 {n}"] = _run_variant(ctx, ref32, n, o, fails, {}, torch.float32, ATOL32)
    fails += [s for s in out.pop("late", []) if s]
    p, r = ctx.world_size, ctx.rank
    for comm, rows in out.items():  # bytes per step = the ring formula summed over buckets, exactly
        for sizes, sent in rows:
            want = sum(C.ring_bytes_per_rank(n, p, 8, "all_reduce")[r][0] for n in sizes)
            if sent != want:
                fails.append(
                    f"p={p} rank {r} ddp comm={comm} buckets {sizes}: sent {sent} bytes per step, formula {want}"
                )
    return fails, finals, out


#: float32 after 5 Adam steps: the summation-order differences (~1e-7 relative) pass through
#: Adam's m/sqrt(v); the largest difference seen is ~2e-6 (lr = 1e-2), so 2e-5.
ATOL32 = 2e-5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_every_variant(world_size):
    ref, ref32 = reference(), reference(torch.float32)
    caps = {k: bucket_bytes_for(k, make_model()) for k in (1, 2, 3)}
    caps32 = {k: bucket_bytes_for(k, make_model(torch.float32)) for k in (1, 2, 3)}
    res = launch(
        _parity_rank, world_size, ref, ref32, caps, caps32, check_shapes=False, timeout=300, threads=1
    )
    fails = [f for v in res.values for f in v[0]]
    assert not fails, f"{len(fails)} failures, first ones:\n" + "\n".join(fails[:15])
    if world_size > 1:
        # the mean over ranks of the bytes sent per step is exactly 2(p-1)/p of all gradients' bytes
        psi_bytes = 8 * sum(q.numel() for q in make_model().parameters() if q.requires_grad)
        for comm in ("builtin", "ring"):
            rows = [v[2][comm] for v in res.values]
            for step in range(len(rows[0])):
                mean = sum(rk[step][1] for rk in rows) / world_size
                assert mean == pytest.approx(allreduce_bytes_per_rank(psi_bytes, world_size), rel=1e-12)
    if world_size == 2:
        # two ranks: a + b = b + a, and both divide by N before summing: ours equals torch's DDP to the bit
        finals = res.values[0][1]
        ours, theirs = finals[f"ddp {dict(buckets=2, bucket_bytes=caps[2], comm='ring')}"], finals[
            f"torch_ddp {dict(bucket_bytes=caps[2])}"]  # fmt: skip
        assert ours == theirs
        assert finals["fp32 ddp"] == finals["fp32 torch_ddp"]


# ----------------------------------------------------------------------------- bad input on ranks
def _expect(fails: list, what: str, err: type, match: str, fn) -> None:
    try:
        fn()
    except err as e:
        if match not in str(e):
            fails.append(f"{what}: {err.__name__} raised, but its message lacks {match!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        fails.append(f"{what}: expected {err.__name__}, got {type(e).__name__}: {e}")
        return
    fails.append(f"{what}: expected {err.__name__}, nothing raised")


def _bad_input_rank(ctx) -> list[str]:
    fails: list[str] = []
    m = make_model()
    x, y = shard_batch(batches(1)[0], ctx.rank, ctx.world_size)
    _expect(
        fails,
        "bucket_bytes=0",
        ValueError,
        "bucket_bytes must be > 0",
        lambda: BucketedDDP(m, ctx, bucket_bytes=0),
    )
    _expect(
        fails, "bucket_bytes=-1", ValueError, "bucket_bytes", lambda: BucketedDDP(m, ctx, bucket_bytes=-1)
    )
    _expect(
        fails, "bucket_bytes str", TypeError, "bucket_bytes", lambda: BucketedDDP(m, ctx, bucket_bytes="1MB")
    )
    _expect(fails, "comm", ValueError, "comm must be one of", lambda: BucketedDDP(m, ctx, comm="nccl2"))
    _expect(fails, "module", TypeError, "module must be an nn.Module", lambda: BucketedDDP([m], ctx))
    _expect(
        fails,
        "algorithm",
        ValueError,
        "algorithm must be one of",
        lambda: AllReduceDP(m, ctx, algorithm="tree"),
    )
    _expect(
        fails,
        "server",
        ValueError,
        "server must be a rank",
        lambda: ParameterServerDP(m, ctx, None, server=5),
    )
    ddp = BucketedDDP(make_model(), ctx, bucket_bytes=4096)
    opt = make_optimizer("adam", ddp.parameters(), LR)
    for k in (0, -2):
        _expect(fails, f"accumulation_steps={k}", ValueError, "accumulation_steps must be >= 1",
                lambda k=k: train_step(ctx, ddp, opt, (x, y), accumulation_steps=k))  # fmt: skip
    _expect(fails, "accumulation_steps=5", ValueError, "divisible by accumulation_steps",
            lambda: train_step(ctx, ddp, opt, (x, y), accumulation_steps=5))  # fmt: skip
    # two backwards without a sync in between (and outside no_sync): a clear error, not a silent double count
    loss_fn(ddp, x, y).backward()
    _expect(fails, "backward twice", RuntimeError, "arrived twice", lambda: loss_fn(ddp, x, y).backward())
    # parameters that change after wrapping: every wrapper notices at its next forward or sync
    changes = {
        "added": lambda mm: mm.register_parameter("extra", nn.Parameter(torch.zeros(3))),
        "replaced": lambda mm: setattr(mm.ln_f, "weight", nn.Parameter(mm.ln_f.weight.detach().clone())),
        "unfrozen": lambda mm: mm.wpe.weight.requires_grad_(True),
        "frozen": lambda mm: mm.ln_f.bias.requires_grad_(False),
        "resized": lambda mm: setattr(mm.ln_f.bias, "data", torch.zeros(9, dtype=torch.float64)),
    }
    wrappers = {"BucketedDDP": lambda mm: BucketedDDP(mm, ctx, bucket_bytes=4096),
                "AllReduceDP": lambda mm: AllReduceDP(mm, ctx)}  # fmt: skip
    for wname, wrap in wrappers.items():
        for cname, change in changes.items():
            mm = make_model()
            w = wrap(mm)
            change(mm)
            _expect(fails, f"{wname} {cname}", ParametersChangedError, "changed after", lambda w=w: w(x))
            _expect(
                fails,
                f"{wname} {cname} sync",
                ParametersChangedError,
                "changed after",
                w.finish_gradient_sync,
            )
    ps = ParameterServerDP(mm := make_model(), ctx, lambda ps_: make_optimizer("adam", ps_, LR))
    mm.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    _expect(fails, "ParameterServerDP added", ParametersChangedError, "changed after", ps.pull)
    # sync_on_step: optimizer.step() finishes the sync itself; the grads it steps on are averaged
    mm, m2 = make_model(), make_model()
    ddp, ar = BucketedDDP(mm, ctx, bucket_bytes=4096), AllReduceDP(m2, ctx)
    seen: list = []
    opt = ddp.sync_on_step(make_optimizer("adam", [q for q in mm.parameters() if q.requires_grad], LR))
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([q.grad.clone() for q in mm.parameters() if q.requires_grad])
    )
    loss_fn(ddp, x, y).backward()
    opt.step()
    loss_fn(ar, x, y).backward()
    ar.finish_gradient_sync()
    want = [q.grad for q in m2.parameters() if q.requires_grad]
    if any(b.handle is not None or b.ready for b in ddp.buckets):
        fails.append("sync_on_step: optimizer.step() left buckets in flight")
    elif not all(torch.allclose(g, w, rtol=0, atol=ATOL) for g, w in zip(seen[0], want)):
        fails.append("sync_on_step: the optimizer stepped on gradients that were not the average")
    # a parameter unused in forward: its bucket still completes (zeros), nobody hangs
    mm = make_model()
    mm.spare = nn.Linear(3, 3).double()
    ddp = BucketedDDP(mm, ctx, bucket_bytes=1)  # one bucket per parameter
    loss_fn(ddp, x, y).backward()
    ddp.finish_gradient_sync()
    if not all(torch.equal(p.grad, torch.zeros_like(p)) for p in mm.spare.parameters()):
        fails.append("unused parameter: its gradient should be zeros after the sync")
    return [f"rank {ctx.rank}: {f}" for f in fails]


def test_bad_input_and_edge_cases():
    res = launch(_bad_input_rank, 2, timeout=120, threads=1)
    fails = [f for v in res.values for f in v]
    assert not fails, "\n".join(fails)
