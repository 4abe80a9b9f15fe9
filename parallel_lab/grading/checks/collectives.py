"""Checks for lesson 01's exercises: ring all-reduce, ring all-gather, all-to-all.

The learner's function has the same signature as ours, `fn(ctx, tensor, group=None)`
(all-to-all: `fn(ctx, tensors, group=None)` with a list of p equally shaped
tensors). Each check launches it on world sizes 1..4 with awkward sizes (0, 1,
fewer elements than ranks, uneven), compares every rank's answer with
torch.distributed's, and makes sure the answer travelled by point-to-point
messages: a built-in collective (torch.distributed.all_reduce, ...) called inside
the learner's function fails the check. The lab's own from-scratch versions pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel_lab.grading.checks import (
    TORCH_COLLECTIVES,
    draw_seed,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

__all__ = ["check_all_to_all", "check_ring_all_gather", "check_ring_all_reduce", "check_ring_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
#: (numel, dtype): empty, one element, fewer than 4 ranks, uneven, bigger and uneven, bf16
CASES = (
    (0, torch.float32),
    (1, torch.float32),
    (3, torch.float32),
    (10, torch.float32),
    (1001, torch.float32),
    (10, torch.bfloat16),
)


# The lab's own answers to these exercises, switched off while the learner's function runs (with
# every built-in collective): what is left is point-to-point (comms.sendrecv, isend, irecv, send, recv).
_ANSWERS = {
    f"parallel_lab.comms.{m}.{n}": "build it from comms.sendrecv / isend / irecv"
    for m, names in {
        "ring": ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_all_reduce_pipelined",
                 "naive_all_reduce", "all_to_all"),
        "tree": ("tree_broadcast", "tree_reduce", "tree_all_reduce"),
        "builtin": ("dist_all_reduce", "dist_broadcast", "dist_reduce", "dist_all_gather", "dist_gather",
                    "dist_scatter", "dist_reduce_scatter", "dist_all_to_all"),
    }.items()
    for n in names
}  # fmt: skip
FORBIDDEN = {
    **_ANSWERS,
    **TORCH_COLLECTIVES,
    "parallel_lab.comms.cost.ring_bytes_per_rank": "",
    "parallel_lab.costmodel.formulas.allreduce_bytes_per_rank": "",
}


def _sent(ctx) -> int:
    """Bytes this rank has sent through the traced comms layer so far."""
    return sum(c.get("sent", 0) for c in ctx.recorder.comm.values())


def _signature(kind: str, p: int, numel: int, itemsize: int, sent: int, where: str) -> None:
    """The bytes a rank sent must be those of the algorithm the exercise asks for."""
    if p == 1 or numel == 0:
        return
    if sent == 0:
        raise AssertionError(
            f"{kind}: {where}: your function sent nothing through parallel_lab.comms; send every message "
            "with comms.sendrecv / isend / irecv / send / recv (they are traced, so the check can count them)"
        )
    if kind == "ring_all_reduce":
        bound = 2 * (p - 1) * -(-numel // p) * itemsize
        if sent > bound:
            raise AssertionError(
                f"{kind}: {where}: this rank sent {sent} bytes; a ring sends at most 2(p-1) chunks of "
                f"ceil(n/p) elements, {bound} bytes (sending whole tensors is not a ring)"
            )
    else:
        want = (p - 1) * numel * itemsize
        if sent != want:
            raise AssertionError(
                f"{kind}: {where}: this rank sent {sent} bytes; every rank must send each of its "
                f"p-1 pieces once, {want} bytes"
            )


def _data(rank: int, numel: int, dtype: torch.dtype, device, salt: int = 0) -> torch.Tensor:
    """Small integers: any summation order gives the same bits, so answers compare exactly.
    Drawn on the CPU from the grade run's seed (in `salt`), then put on the rank's device."""
    g = torch.Generator().manual_seed(7919 * rank + numel + salt)
    return torch.randint(-8, 9, (numel,), generator=g).to(device=device, dtype=dtype)


def _compare(what: str, got, want: torch.Tensor, where: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: {where}: expected a tensor, got {type(got).__name__}")
    if got.numel() != want.numel():
        raise AssertionError(
            f"{what}: {where}: result has {got.numel()} elements (shape {tuple(got.shape)}), "
            f"expected {want.numel()} (shape {tuple(want.shape)})"
        )
    g, w = got.detach().reshape(-1).double().cpu(), want.reshape(-1).double().cpu()
    wrong = (g != w).nonzero()
    if len(wrong):
        i = int(wrong[0])
        raise AssertionError(
            f"{what}: {where}: max abs diff {(g - w).abs().max().item():g} over {len(wrong)} wrong "
            f"element(s); first at index {i}: got {g[i].item():g}, expected {w[i].item():g}"
        )


def _run_cases(ctx, fn: Callable, kind: str, seed: int) -> int:
    """On every rank: run the learner's fn on each case and compare; returns the case count. The
    numbers, and one size, are drawn from this grade run's seed: a table of one run's answers fails."""
    import random

    p, r = ctx.world_size, ctx.rank
    drawn = random.Random(seed).randint(11, 999)  # one more uneven size, the same on every rank
    for numel, dtype in (*CASES, (drawn, torch.float32)):
        where = f"world_size={p}, numel={numel}, dtype={str(dtype).replace('torch.', '')}, rank {r}"
        x = _data(r, numel, dtype, ctx.device, salt=seed)
        if kind == "ring_all_reduce":
            want = x.clone()
            dist.all_reduce(want)
            arg = x.clone()
        elif kind == "ring_all_gather":
            parts = [torch.empty_like(x) for _ in range(p)]
            dist.all_gather(parts, x)
            want, arg = torch.stack(parts), x.clone()
        else:
            arg = [_data(r, numel, dtype, ctx.device, salt=seed + 100 + j) for j in range(p)]
            want = [torch.empty_like(x) for _ in range(p)]
            dist.all_to_all(want, [a.clone() for a in arg])
        before = _sent(ctx)
        try:
            with unavailable(FORBIDDEN, f"this exercise ({kind})"):
                got = fn(ctx, arg)
        except NotImplementedError:
            raise
        except AssertionError as e:  # a switched-off function, or an assert in the learner's code
            raise AssertionError(f"{kind}: {where}: {e or 'an assert in your function failed'}") from e
        except Exception as e:
            raise AssertionError(f"{kind}: {where}: your function raised {type(e).__name__}: {e}") from e
        sent = _sent(ctx) - before
        if kind == "ring_all_reduce" and got is None:
            got = arg  # reduced in place, like dist.all_reduce
        if kind == "all_to_all":
            if not isinstance(got, (list, tuple)) or len(got) != p:
                raise AssertionError(
                    f"all_to_all: {where}: expected a list of {p} tensors, got {type(got).__name__}"
                )
            for j in range(p):
                _compare("all_to_all", got[j], want[j], f"{where}, piece from rank {j}")
        else:
            if isinstance(got, (list, tuple)) and kind == "ring_all_gather":
                got = torch.stack(list(got)) if len(got) else torch.empty(0)
            _compare(kind, got, want, where)
        _signature(
            kind, p, numel, x.element_size(), sent, where
        )  # the answer is right: was it this algorithm?
    return len(CASES) + 1


def _check(fn: Callable, kind: str, check: str) -> None:
    require_callable(fn)
    total, seed = 0, draw_seed() % 2**40
    for p in WORLD_SIZES:
        try:
            result = launch_learner(_run_cases, p, fn, kind, seed, timeout=30.0)
        except Exception as e:
            exc_type = getattr(e, "exc_type", None)
            if exc_type in ("AssertionError", "WriteItYourself"):  # our verdict, raised on a rank
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(
                    f"{kind}: world_size={p}: the ranks did not finish in 30 s; a send whose matching "
                    "recv is never posted (or posted in the wrong order) waits forever"
                ) from None
            raise
        total += result.values[0]
    passed(check, f"all {total} cases")


def check_ring_all_reduce(fn: Callable) -> None:
    """`fn(ctx, tensor, group=None)` returns (or leaves in `tensor`) the sum over ranks."""
    _check(fn, "ring_all_reduce", "check_ring_all_reduce")


def check_ring_all_gather(fn: Callable) -> None:
    """`fn(ctx, tensor, group=None)` returns every rank's tensor in rank order, shape (p, *tensor.shape)."""
    _check(fn, "ring_all_gather", "check_ring_all_gather")


def check_all_to_all(fn: Callable) -> None:
    """`fn(ctx, tensors, group=None)`: `tensors[j]` goes to rank j; returns p tensors, [j] from rank j."""
    _check(fn, "all_to_all", "check_all_to_all")


# ----------------------------------------------------------------------------- predict, then measure
def _measure_ring_bytes(ctx, sizes: tuple[int, ...]) -> list[int]:
    """Bytes this rank sends in the lab's ring all-reduce of each size (float32), read from the tracer."""
    from parallel_lab import comms

    out = []
    for n in sizes:
        before = _sent(ctx)
        comms.ring_all_reduce(ctx, torch.ones(n, device=ctx.device))
        out.append(_sent(ctx) - before)
    return out


def check_ring_bytes(fn: Callable) -> None:
    """`fn(n, p, rank, itemsize)` -> the bytes `rank` sends in a ring all-reduce of n elements on p ranks,
    predicted, then compared with what the lab's ring sends, measured by the byte counter (exactly)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (ring_bytes)")
    import random

    rnd = random.Random(draw_seed())
    sizes = (1, 3, 10, 1001, 4096, rnd.randint(11, 5000), rnd.randint(5001, 100_000))  # two drawn per run
    cases = 0
    for p in (2, 3, 4):
        measured = launch_learner(_measure_ring_bytes, p, sizes, timeout=60.0).values
        for r in range(p):
            for n, got_bytes in zip(sizes, measured[r]):
                said = fn(n, p, r, 4)
                assert isinstance(said, (int, float)) and not isinstance(said, bool), (
                    f"ring_bytes({n}, {p}, {r}, 4) must return a number of bytes, got {type(said).__name__}"
                )
                hint = ""
                if said == 2 * (p - 1) * n * 4 // p or said == 2 * (p - 1) / p * n * 4:
                    hint = "; 2(p-1)/p n is the average over ranks: chunks differ by one element when p does not divide n"
                assert said == got_bytes, (
                    f"n={n} elements on p={p} ranks, rank {r}: you predict {said} bytes, the ring sent {got_bytes}{hint}"
                )
                cases += 1
    passed("check_ring_bytes", f"{cases} predictions equal the bytes measured on 2, 3 and 4 ranks")
