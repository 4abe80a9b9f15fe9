"""Checks for lesson 08's exercises: column- and row-parallel linear layers, and f/g.

The learner writes `torch.autograd.Function`s whose `apply` takes
`(x, weight, bias, ctx, group)` (linears) or `(x, ctx, group)` (f, g); `weight` and
`bias` are this rank's shards. Each check runs them on 1, 2 and 4 gloo ranks and
compares, on every rank, the output and every gradient with the full single-process
layer: a column-parallel rank's output and weight/bias gradients against their slice
(`chunk(tp)[rank]`), the input gradient against the whole; a row-parallel rank's output
against the whole, its weight gradient against its column slice. Sums over ranks run
in another order than one matmul, so values compare to within fp32 rounding
(atol 1e-5, rtol 1e-4), which any missing or doubled collective exceeds by far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
)

__all__ = ["check_block_bytes", "check_column_parallel_linear", "check_f_and_g", "check_row_parallel_linear"]

WORLD_SIZES = (1, 2, 4)
# The lab's tensor-parallel layers and operators and torch's DTensor styles, switched off on the
# ranks while a check runs (parallel_lab.comms' collectives stay).
FORBIDDEN = {
    **family("parallel_lab.tensor_parallel.operators", "parallel_lab.tensor_parallel.layers"),
    "torch.distributed.tensor.parallel.parallelize_module": "",
}
ATOL, RTOL = 1e-5, 1e-4
B, T, IN, OUT = 3, 5, 12, 24  # in/out features divisible by every world size above


def _t(*shape: int, seed: int, device: Any) -> torch.Tensor:
    """Seeded on the CPU (the same numbers on every machine), then on the rank's device."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _close(what: str, got: Any, want: torch.Tensor, where: str, hint: str = "") -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: {what} should be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{where}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    got = got.detach().float()
    if not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
        diff = (got - want).abs()
        i = int(diff.argmax())
        raise AssertionError(
            f"{where}: {what} differs by up to {diff.max().item():.3g} (first worst at flat index {i}: "
            f"got {got.reshape(-1)[i].item():.6g}, expected {want.reshape(-1)[i].item():.6g})"
            + (f"; {hint}" if hint else "")
        )


def _call(where: str, fn: Callable, *args: Any) -> Any:
    return call_learner(fn, where, *args)


def _grad(where: str, t: torch.Tensor, what: str) -> torch.Tensor:
    if t.grad is None:
        raise AssertionError(f"{where}: no gradient reached {what}: backward must return one for it")
    return t.grad


def _column_rank(ctx, Fn, salt: int) -> int:
    p, r = ctx.world_size, ctx.rank
    where = f"ColumnParallelLinear, world_size={p}, rank {r}"
    w, b, x0, gy = (
        _t(OUT, IN, seed=salt + 1, device=ctx.device),
        _t(OUT, seed=salt + 2, device=ctx.device),
        _t(B, T, IN, seed=salt + 3, device=ctx.device),
        _t(B, T, OUT, seed=salt + 4, device=ctx.device),
    )
    x = x0.clone().requires_grad_()
    wf, bf = w.clone().requires_grad_(), b.clone().requires_grad_()
    (F.linear(x, wf, bf) * gy).sum().backward()  # the full layer: the reference
    want_y = F.linear(x0, w, b).chunk(p, -1)[r]
    xs = x0.clone().requires_grad_()
    ws, bs = w.chunk(p)[r].clone().requires_grad_(), b.chunk(p)[r].clone().requires_grad_()
    y = _call(f"{where}, forward", Fn.apply, xs, ws, bs, ctx, None)
    _close(
        "the output", y, want_y, where, "rank r holds output features r*out/p .. (r+1)*out/p of x @ W.T + b"
    )
    _call(f"{where}, backward", lambda: (y * gy.chunk(p, -1)[r]).sum().backward())
    _close("the input gradient", _grad(where, xs, "x"), x.grad, where,
           "each rank only has grad_out_r @ W_r, a partial sum: all-reduce it over the TP group")  # fmt: skip
    _close("the weight gradient", _grad(where, ws, "weight"), wf.grad.chunk(p)[r], where,
           "grad_W_r = grad_out_r.T @ x, summed over batch and time")  # fmt: skip
    _close("the bias gradient", _grad(where, bs, "bias"), bf.grad.chunk(p)[r], where,
           "grad_b_r = grad_out_r summed over batch and time")  # fmt: skip
    return 1


def _row_rank(ctx, Fn, salt: int) -> int:
    p, r = ctx.world_size, ctx.rank
    where = f"RowParallelLinear, world_size={p}, rank {r}"
    w, b, x0, gy = (
        _t(IN, OUT, seed=salt + 5, device=ctx.device),
        _t(IN, seed=salt + 6, device=ctx.device),
        _t(B, T, OUT, seed=salt + 7, device=ctx.device),
        _t(B, T, IN, seed=salt + 8, device=ctx.device),
    )
    x = x0.clone().requires_grad_()
    wf, bf = w.clone().requires_grad_(), b.clone().requires_grad_()
    (F.linear(x, wf, bf) * gy).sum().backward()
    xs = x0.chunk(p, -1)[r].clone().requires_grad_()  # (B, T, OUT/p): the input comes split
    ws, bs = w.chunk(p, 1)[r].clone().requires_grad_(), b.clone().requires_grad_()
    y = _call(f"{where}, forward", Fn.apply, xs, ws, bs, ctx, None)
    want = F.linear(x0, w, b)
    hint = "sum the partial products x_r @ W_r.T over the TP group (all-reduce), then add the bias once"
    if isinstance(y, torch.Tensor) and y.shape == want.shape and p > 1:
        if torch.allclose(y.detach(), want + (p - 1) * b, atol=ATOL, rtol=RTOL):
            hint = (
                "the bias was added on every rank before the all-reduce, so it counts p times: add it after"
            )
    _close("the output", y, want, where, hint)
    _call(f"{where}, backward", lambda: (y * gy).sum().backward())
    _close("the input gradient", _grad(where, xs, "x"), x.grad.chunk(p, -1)[r], where,
           "grad_x_r = grad_out @ W_r needs no communication: grad_out is the same on every rank")  # fmt: skip
    _close("the weight gradient", _grad(where, ws, "weight"), wf.grad.chunk(p, 1)[r], where,
           "grad_W_r = grad_out.T @ x_r, summed over batch and time")  # fmt: skip
    _close("the bias gradient", _grad(where, bs, "bias"), bf.grad, where,
           "the bias is replicated and every rank already sees the whole grad_out: no all-reduce")  # fmt: skip
    return 1


def _fg_rank(ctx, f, g, salt: int) -> int:
    p, r = ctx.world_size, ctx.rank
    where = f"f/g, world_size={p}, rank {r}"
    x = _t(B, IN, seed=salt + 9, device=ctx.device).requires_grad_()
    y = _call(f"{where}, f forward", f.apply, x, ctx, None)
    _close("f's output", y, x.detach(), f"{where}", "f is the identity in forward")
    coeff = [
        _t(B, IN, seed=salt + 10 + k, device=ctx.device) for k in range(p)
    ]  # each rank's own upstream gradient
    _call(f"{where}, f backward", lambda: (y * coeff[r]).sum().backward())
    _close("f's input gradient", _grad(where, x, "x"), sum(coeff), where,
           "f's backward all-reduces: every rank gets the sum of all ranks' gradients")  # fmt: skip
    parts = [_t(B, IN, seed=salt + 20 + k, device=ctx.device) for k in range(p)]
    xr = parts[r].clone().requires_grad_()
    z = _call(f"{where}, g forward", g.apply, xr, ctx, None)
    _close("g's output", z, sum(parts), where, "g's forward all-reduces the partial sums")
    gz = _t(B, IN, seed=salt + 30, device=ctx.device)
    _call(f"{where}, g backward", lambda: (z * gz).sum().backward())
    _close("g's input gradient", _grad(where, xr, "x"), gz, where,
           "g's backward is the identity (an all-reduce there would multiply it by p)")  # fmt: skip
    # Megatron's MLP from them: f, column linear, GeLU, row linear, g
    w1, b1, w2, b2, x0 = (
        _t(OUT, IN, seed=salt + 40, device=ctx.device),
        _t(OUT, seed=salt + 41, device=ctx.device),
        _t(IN, OUT, seed=salt + 42, device=ctx.device),
        _t(IN, seed=salt + 43, device=ctx.device),
        _t(B, IN, seed=salt + 44, device=ctx.device),
    )
    xf, w1f, w2f = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    (F.linear(F.gelu(F.linear(xf, w1f, b1)), w2f, b2) * gz).sum().backward()
    xs = x0.clone().requires_grad_()
    w1s, w2s = w1.chunk(p)[r].clone().requires_grad_(), w2.chunk(p, 1)[r].clone().requires_grad_()
    h = F.gelu(F.linear(f.apply(xs, ctx, None), w1s, b1.chunk(p)[r]))  # (B, OUT/p)
    out = g.apply(F.linear(h, w2s), ctx, None) + b2  # (B, IN)
    mlp = f"{where}, Megatron MLP built from your f and g"
    _close("the output", out, F.linear(F.gelu(F.linear(x0, w1, b1)), w2, b2), mlp)
    (out * gz).sum().backward()
    _close("the input gradient", _grad(mlp, xs, "x"), xf.grad, mlp)
    _close("fc's weight gradient", w1s.grad, w1f.grad.chunk(p)[r], mlp)
    _close("proj's weight gradient", w2s.grad, w2f.grad.chunk(p, 1)[r], mlp)
    return 1


def _run(rank_fn: Callable, what: str, *fns: Any) -> None:
    for fn in fns:
        require_callable(getattr(fn, "apply", None), f"{what}.apply (a torch.autograd.Function subclass)")
    salt = draw_seed() % 2**40  # the weights and inputs of every case, drawn afresh every grade run
    for p in WORLD_SIZES:
        try:
            launch_learner(
                guarded(rank_fn, FORBIDDEN, f"this exercise ({what})"), p, *fns, salt, timeout=30.0
            )
        except NotImplementedError:
            raise
        except Exception as e:
            if getattr(e, "exc_type", None) in (
                "AssertionError",
                "WriteItYourself",
            ):  # our verdict on a rank: the message only
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(
                    f"{what}: world_size={p}: the ranks did not finish in 30 s; does every rank call the same "
                    "collectives in the same order (forward on all ranks, backward on all ranks)?"
                ) from None
            raise


def check_column_parallel_linear(Fn: Any) -> None:
    """`Fn.apply(x, weight_shard, bias_shard, ctx, group)`: y_r = x W_r^T + b_r; backward all-reduces grad_x."""
    _run(_column_rank, "ColumnParallelLinear", Fn)
    passed("check_column_parallel_linear", "forward and backward on 1, 2 and 4 ranks")


def check_row_parallel_linear(Fn: Any) -> None:
    """`Fn.apply(x_shard, weight_shard, bias, ctx, group)`: y = all-reduce(x_r W_r^T) + b; no comm backward."""
    _run(_row_rank, "RowParallelLinear", Fn)
    passed("check_row_parallel_linear", "forward and backward on 1, 2 and 4 ranks")


def check_f_and_g(f: Any, g: Any) -> None:
    """`f.apply(x, ctx, group)`: identity / all-reduce; `g.apply(x, ctx, group)`: all-reduce / identity."""
    _run(_fg_rank, "f and g", f, g)
    passed("check_f_and_g", "f, g and a Megatron MLP built from them on 1, 2 and 4 ranks")


# ----------------------------------------------------------------------------- predict, then measure
_SHAPES = ((2, 8, 16), (3, 5, 12), (1, 12, 24))  # (batch, seq, hidden): b*s*h not always divisible by p


def _measure_block_bytes(ctx, shapes: tuple, sequence_parallel: bool) -> list[int]:
    """Bytes this rank sends in one ParallelBlock forward + backward (ring collectives), per shape."""
    from parallel_lab.models import GPTConfig, build_model
    from parallel_lab.tensor_parallel import ParallelBlock, split

    out = []
    for b, s, h in shapes:
        cfg = GPTConfig(vocab=16, seq_len=s, d_model=h, n_heads=ctx.world_size, n_layers=1)
        block = ParallelBlock.from_block(ctx, build_model(cfg, 0).blocks[0], sequence_parallel=sequence_parallel,
                                         impl="ring")  # fmt: skip
        x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1)).to(ctx.device)
        if sequence_parallel:
            x = split(ctx, x, 1)  # (B, T/tp, C): this rank's tokens
        x.requires_grad_()
        before = ctx.recorder.comm_totals()["sent"]
        block(x).sum().backward()
        out.append(ctx.recorder.comm_totals()["sent"] - before)
    return out


def check_block_bytes(fn: Callable) -> None:
    """`fn(b, s, h, p, rank, itemsize)` -> bytes `rank` sends in one transformer block's forward + backward
    under tensor parallelism on p ranks (ring collectives, chunks from comms.chunk_sizes); predicted, then
    compared with the byte counter of real runs, with and without sequence parallelism (exactly)."""
    require_callable(fn)
    fn = guarded(fn, {**FORBIDDEN, "parallel_lab.tensor_parallel.transformer.tp_comm_bytes_per_layer": "",
                      "parallel_lab.comms.cost.ring_bytes_per_rank": ""}, "this exercise (block_bytes)")  # fmt: skip
    import random

    rnd = random.Random(draw_seed())  # one more shape, drawn afresh every grade run (heads = p divide h)
    drawn = (rnd.randint(1, 3), rnd.choice((4, 8, 12, 16)), 4 * rnd.randint(2, 8))
    cases = 0
    for p in (2, 4):
        for sp in (False, True):
            shapes = tuple(sh for sh in (*_SHAPES, drawn) if not sp or sh[1] % p == 0)
            res = launch_learner(_measure_block_bytes, p, shapes, sp, timeout=60.0)
            for r, sent in enumerate(res.values):
                for (b, s, h), got in zip(shapes, sent):
                    said = fn(b, s, h, p, r, 4)
                    where = f"b={b}, s={s}, h={h} on p={p} ranks ({'with' if sp else 'without'} sequence parallelism), rank {r}"
                    assert said == got, f"{where}: you predict {said} bytes, the rank sent {got}"
                    cases += 1
    passed(
        "check_block_bytes", f"{cases} predictions equal the bytes measured (TP and TP + SP, 2 and 4 ranks)"
    )
