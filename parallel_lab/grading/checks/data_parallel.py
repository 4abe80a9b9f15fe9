"""Checks for lesson 03's exercises: average gradients with all-reduce, assign parameters to buckets,
and (bonus) a DDP gradient hook.

The gradient checks train a small float64 GPT with tied embeddings and a frozen
parameter: each rank runs forward and backward on its slice of a batch, the
learner's code synchronises, and every gradient must equal the gradient of the
whole batch computed in one process, on every rank, to 1e-12 (float64: only the
order of the sums differs, ~1e-16 relative). The bucket check compares with the
lab's `assign_buckets` on a real model and on hand-made parameter lists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from parallel_lab.grading.checks import (
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
)

__all__ = ["check_assign_buckets", "check_average_gradients", "check_ddp_grad_hook", "check_ddp_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
BATCH = 12
TOL = 1e-12  # float64; see the module docstring


def _model() -> nn.Module:
    from parallel_lab.models import GPTConfig, build_model

    m = build_model(GPTConfig(vocab=25, seq_len=8, d_model=8, n_heads=2, n_layers=2), seed=0).double()
    m.wpe.weight.requires_grad_(False)  # frozen: no gradient to average
    return m


def _reference(seed: int = 3) -> tuple[tuple, dict[str, torch.Tensor]]:
    from parallel_lab.models import synthetic_batch

    batch = synthetic_batch("tokens", BATCH, seq_len=8, vocab=25, seed=seed)
    m = _model()
    m(*batch).backward()
    return batch, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _compare(model: nn.Module, want: dict, where: str, world_size: int) -> None:
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{where}: {n} is frozen (requires_grad=False) but now has a .grad"
            continue
        assert p.grad is not None, f"{where}: {n}.grad is None after your code ran"
        grad = p.grad.cpu()
        diff = (grad - want[n]).abs().max().item()
        if diff > TOL:
            ratio = (grad.norm() / want[n].norm()).item()
            hint = f" (|your grad| / |expected| = {ratio:.4g})"
            if world_size > 1 and abs(ratio - world_size) < 1e-6:
                hint = f" (it is {world_size}x the average: the sum over ranks; divide by world_size)"
            elif world_size > 1 and (grad - want[n]).abs().max() > 1e-3 and abs(ratio - 1) > 0.05:
                hint += "; is it still this rank's own gradient (not all-reduced)?"
            raise AssertionError(
                f"{where}: {n}.grad differs from the whole batch's gradient by up to {diff:.3g}{hint}"
            )


# The lab's data parallelism and torch's DDP, switched off while the learner's function runs
# (torch.distributed's collectives stay: the exercises are built from them).
FORBIDDEN = {
    **family("parallel_lab.data_parallel.naive", "parallel_lab.data_parallel.ddp"),
    "torch.nn.parallel.distributed.DistributedDataParallel.__init__": "",
}


def _grad_rank(ctx, fn: Callable, kind: str, batch: tuple, want: dict) -> int:
    import torch.distributed as dist

    fn = guarded(
        fn, FORBIDDEN, f"this exercise ({'average_gradients' if kind == 'average' else 'ddp_grad_hook'})"
    )

    from parallel_lab.data_parallel import shard_batch

    x, y = (t.to(ctx.device) for t in shard_batch(batch, ctx.rank, ctx.world_size))
    model = _model().to(ctx.device)  # the learner's all-reduces run on this rank's device (NCCL: a GPU)
    where = f"world_size={ctx.world_size}, rank {ctx.rank}"
    if kind == "average":
        model(x, y).backward()
        fn(ctx, model)
    else:
        pending: list = []
        calls: list[bool] = []

        def hook(p: torch.Tensor) -> None:
            before = len(pending)
            fn(ctx, p, pending)
            calls.append(torch._C._current_graph_task_id() != -1 and len(pending) == before + 1)

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)
        model(x, y).backward()
        n_train = sum(1 for p in model.parameters() if p.requires_grad)
        assert len(calls) == n_train and all(calls), (
            f"{where}: each call of your hook must append exactly one pending all-reduce to `pending` "
            f"({sum(calls)} of {n_train} calls did)"
        )
        for w in pending:
            assert hasattr(w, "wait"), (
                f"{where}: `pending` holds a {type(w).__name__}; append what "
                "dist.all_reduce(..., async_op=True) returns (it has .wait())"
            )
            w.wait()
    dist.barrier()
    _compare(model, want, where, ctx.world_size)
    return 1


def _check_grads(fn: Callable, kind: str, check: str) -> None:
    require_callable(fn)
    batch, want = _reference(draw_seed() % 2**31)  # a batch drawn afresh every grade run
    for p in WORLD_SIZES:
        try:
            launch_learner(_grad_rank, p, fn, kind, batch, want, timeout=60.0, threads=1)
        except Exception as e:
            if getattr(e, "exc_type", None) in (
                "AssertionError",
                "WriteItYourself",
            ):  # our verdict, raised on a rank
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(
                    f"{check}: world_size={p}: the ranks did not finish in 60 s; every rank must call the "
                    "same collectives on tensors of the same shape, in the same order"
                ) from None
            raise
    passed(check, f"gradients equal the whole batch's on {len(WORLD_SIZES)} world sizes")


def check_average_gradients(fn: Callable) -> None:
    """`fn(ctx, model)` runs after backward and leaves every `.grad` averaged over the ranks."""
    _check_grads(fn, "average", "check_average_gradients")


def check_ddp_grad_hook(fn: Callable) -> None:
    """`fn(ctx, param, pending)`, called by autograd the moment `param.grad` is complete, starts an
    asynchronous all-reduce that leaves the average in `param.grad` and appends its work to `pending`."""
    _check_grads(fn, "hook", "check_ddp_grad_hook")


# ----------------------------------------------------------------------------- buckets
def _names(buckets, names: dict[int, str], where: str) -> list[list[str]]:
    assert isinstance(buckets, (list, tuple)), (
        f"{where}: return a list of buckets, got {type(buckets).__name__}"
    )
    out = []
    for i, b in enumerate(buckets):
        assert isinstance(b, (list, tuple)), (
            f"{where}: bucket {i} must be a list of parameters, got {type(b).__name__}"
        )
        row = []
        for p in b:
            assert id(p) in names, (
                f"{where}: bucket {i} holds something that is not one of the given parameters"
            )
            row.append(names[id(p)])
        out.append(row)
    return out


def check_assign_buckets(fn: Callable) -> None:
    """`fn(params, bucket_bytes)` -> list of buckets (lists of parameters), like `ddp.assign_buckets`."""
    require_callable(fn)
    from parallel_lab.data_parallel import assign_buckets

    model = _model()
    named = list(model.named_parameters())
    params = [p for _, p in named] + [model.lm_head.weight]  # the tied weight, listed twice
    names = {id(p): n for n, p in named}
    total = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)
    toy = [nn.Parameter(torch.zeros(n)) for n in (4, 2, 3, 5)]  # 16, 8, 12, 20 bytes (fp32)
    frozen = nn.Parameter(torch.zeros(10), requires_grad=False)
    toy_names = {id(p): c for p, c in zip(toy, "abcd")} | {id(frozen): "frozen"}
    import random

    rnd = random.Random(draw_seed())  # two bucket sizes and a parameter list drawn afresh every grade run
    drawn = [nn.Parameter(torch.zeros(rnd.randint(1, 40))) for _ in range(rnd.randint(5, 9))]
    drawn_names = {id(q): f"p{i}" for i, q in enumerate(drawn)}
    cases = [(params, names, b, "TinyGPT") for b in (10 * total, total // 2, total // 3, 3000, 1000, 64, 1)]
    cases += [(params, names, rnd.randint(65, total), "TinyGPT") for _ in range(2)]
    cases += [
        ([toy[0], frozen, toy[1], toy[2], toy[3]], toy_names, b, "a, frozen, b, c, d")
        for b in (1, 20, 21, 36, 1e9)
    ]
    label = ", ".join(f"p{i} ({q.numel()} elements)" for i, q in enumerate(drawn))
    cases += [(drawn, drawn_names, rnd.randint(4, 200), label) for _ in range(2)]
    for ps, nm, b, label in cases:
        where = f"params = {label}, bucket_bytes = {b:g}"
        got = _names(guarded(fn, FORBIDDEN, "this exercise (assign_buckets)")(ps, b), nm, where)
        want = _names(assign_buckets(ps, b), nm, where)
        if got != want:
            flat_got = [n for row in got for n in row]
            flat_want = [n for row in want for n in row]
            if sorted(flat_got) != sorted(flat_want):
                extra = (
                    sorted(set(flat_got) - set(flat_want))
                    or [n for n in flat_got if flat_got.count(n) > 1][:1]
                )
                missing = sorted(set(flat_want) - set(flat_got))
                raise AssertionError(
                    f"{where}: wrong parameters in the buckets; extra or repeated: {extra}, missing: {missing} "
                    "(leave frozen parameters out; a tied weight listed twice goes in once)"
                )
            if flat_got != flat_want:
                raise AssertionError(
                    f"{where}: parameters in the wrong order; expected {flat_want[:4]}... (reverse registration "
                    f"order: the last parameter first), got {flat_got[:4]}..."
                )
            raise AssertionError(
                f"{where}: expected {len(want)} buckets of sizes {[len(r) for r in want]}, got {len(got)} of sizes "
                f"{[len(r) for r in got]}; close a bucket as soon as it holds >= bucket_bytes"
            )
    passed("check_assign_buckets", f"all {len(cases)} cases")


# ----------------------------------------------------------------------------- predict, then measure
def _measure_ddp_bytes(ctx, bucket_bytes: int) -> dict:
    """One BucketedDDP step (from-scratch ring all-reduces) of the check's small GPT: its buckets and
    the bytes this rank sent."""
    from parallel_lab.data_parallel import BucketedDDP, shard_batch

    batch, _ = _reference()
    x, y = (t.to(ctx.device) for t in shard_batch(batch, ctx.rank, ctx.world_size))
    ddp = BucketedDDP(
        _model().to(ctx.device), ctx, bucket_bytes=bucket_bytes, comm="ring", broadcast_params=False
    )
    before = sum(c.get("sent", 0) for c in ctx.recorder.comm.values())
    ddp(x, y).backward()
    ddp.finish_gradient_sync()
    sent = sum(c.get("sent", 0) for c in ctx.recorder.comm.values()) - before
    return {"buckets": [b.buffer.numel() for b in ddp.buckets], "itemsize": ddp.buckets[0].buffer.element_size(),
            "sent": sent}  # fmt: skip


def check_ddp_bytes(fn: Callable) -> None:
    """`fn(bucket_numels, p, rank, itemsize)` -> the bytes `rank` sends in one step of bucketed DDP whose
    buckets hold `bucket_numels` elements each, every bucket all-reduced with the ring of lesson 01;
    predicted, then compared with the byte counter of a real run (exactly)."""
    require_callable(fn)
    fn = guarded(fn, {**FORBIDDEN, **family("parallel_lab.comms.cost", keep=("chunk_sizes",)), "parallel_lab.costmodel.formulas.allreduce_bytes_per_rank": ""},
                 "this exercise (ddp_bytes)")  # fmt: skip
    cases = 0
    drawn = 200 + draw_seed() % 2801  # the third run's bucket size, drawn afresh every grade run
    for p, bucket_bytes in ((2, 1 << 30), (3, 2048), (4, drawn)):
        for r, got in enumerate(
            launch_learner(_measure_ddp_bytes, p, bucket_bytes, timeout=60.0, threads=1).values
        ):
            said = fn(list(got["buckets"]), p, r, got["itemsize"])
            where = f"{len(got['buckets'])} bucket(s) of {got['buckets']} elements on {p} ranks, rank {r}"
            hint = ""
            total = sum(got["buckets"]) * got["itemsize"]
            if said == 2 * (p - 1) * total / p or said == 2 * (p - 1) * total // p:
                hint = " (2(p-1)/p is the average; each bucket's ring cuts it into chunks that differ by one element)"
            assert said == got["sent"], (
                f"{where}: you predict {said} bytes, the rank sent {got['sent']}{hint}"
            )
            cases += 1
    passed("check_ddp_bytes", f"{cases} ranks in 3 runs sent exactly what you predicted")
