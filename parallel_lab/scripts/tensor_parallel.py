"""Lesson 08 as a script: a TinyGPT trained tensor-parallel, checked against one process.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.tensor_parallel
    torchrun --nproc-per-node 4 -m parallel_lab.scripts.tensor_parallel --sequence-parallel
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.tensor_parallel
    python -m parallel_lab.scripts.tensor_parallel            # no launcher: 4 local ranks

Every rank is one tensor-parallel rank (TP size = world size) and sees the whole batch.
Each rank also trains the single-process model on the same batches, so it can compare
the loss, its gradient shards and, at the end, its parameter shards with the slices of
the reference. Then one transformer layer's forward + backward is run alone to count
the bytes it sends, against the 8·b·s·h formula. Rank 0 prints the table and
writes the trace (`--trace`, default runs/tensor_parallel.json).
"""

from __future__ import annotations

import argparse
import sys

import torch

from parallel_lab.models import GPTConfig, build_model, make_optimizer, synthetic_batch
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world
from parallel_lab.tensor_parallel import ParallelBlock, TensorParallelGPT, split, tp_comm_bytes_per_layer

#: Sums over ranks run in another order than one process's matmul: fp32 rounding
#: (~1e-7 relative) keeps every difference well below these. The optimizer is SGD with
#: momentum, not Adam: the key bias's true gradient is exactly 0 (softmax ignores a
#: constant added to every score), so both runs hold rounding noise there (~1e-9), and
#: Adam's g/sqrt(v) turns that noise into steps of +-lr whose signs need not agree.
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-5, 1e-5
OPTIMIZER, LR = "momentum", 0.05


def layer_bytes(
    ctx, batch: int, seq: int, cfg: GPTConfig, sequence_parallel: bool, regather: bool, impl: str
):
    """Bytes this rank sends in one ParallelBlock forward + backward (nothing else runs meanwhile)."""
    block = ParallelBlock.from_block(
        ctx,
        build_model(cfg, ctx.seed).blocks[0],
        sequence_parallel=sequence_parallel,
        regather=regather,
        impl=impl,
    )
    x = torch.randn(batch, seq, cfg.d_model, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    if sequence_parallel:
        x = split(ctx, x, 1)  # (B, T/tp, C): this rank's tokens
    x.requires_grad_()
    before = ctx.recorder.comm_totals()["sent"]
    with ctx.span("one layer fwd+bwd", "compute"):
        block(x).sum().backward()
    return ctx.recorder.comm_totals()["sent"] - before


def run_tensor_parallel(
    ctx,
    steps: int = 3,
    batch: int = 4,
    seq: int = 16,
    d_model: int = 64,
    heads: int = 4,
    layers: int = 2,
    sequence_parallel: bool = False,
    regather: bool = False,
    impl: str = "ring",
) -> dict:
    """Train `steps` TP steps next to the single-process reference; return diffs and bytes."""
    cfg = GPTConfig(vocab=64, seq_len=seq, d_model=d_model, n_heads=heads, n_layers=layers)
    ref = build_model(cfg, ctx.seed).to(ctx.device)  # the same weights on every rank
    model = TensorParallelGPT(ctx, ref, sequence_parallel=sequence_parallel, regather=regather, impl=impl)
    if ctx.memory is not None:
        ctx.memory.register_module(model)
    opt, opt_ref = (
        make_optimizer(OPTIMIZER, model.parameters(), LR),
        make_optimizer(OPTIMIZER, ref.parameters(), LR),
    )
    losses, loss_diff, grad_diff = [], 0.0, 0.0
    for step in range(steps):
        x, y = synthetic_batch("tokens", batch, seq_len=seq, vocab=64, seed=step, device=ctx.device)
        with ctx.span(f"forward {step}", "compute"):
            loss = model(x, y)
        with ctx.span(f"backward {step}", "compute"):
            loss.backward()
            model.sync_grads()
        loss_ref = ref(x, y)
        loss_ref.backward()
        loss_diff = max(loss_diff, abs(loss.item() - loss_ref.item()))
        grad_diff = max(grad_diff, max(model.diff_to(ref, grads=True).values()))
        with ctx.span(f"step {step}", "optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses.append(loss.item())
    param_diff = max(model.diff_to(ref).values())
    measured = layer_bytes(ctx, batch, seq, cfg, sequence_parallel, regather, impl)
    formula = tp_comm_bytes_per_layer(batch, seq, d_model, ctx.world_size, 4, sequence_parallel, regather)
    return {
        "losses": losses,
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "layer_bytes": measured,
        "layer_formula": formula[ctx.rank],
        "params_here": sum(p.numel() for p in model.parameters()),
    }


def time_mlp(ctx, d_model: int = 256, batch: int = 8, seq: int = 64, repeats: int = 5,
             impls: tuple[str, ...] = ("dtensor", "ring", "builtin")) -> dict:  # fmt: skip
    """Seconds per forward + backward of one Megatron MLP (C -> 4C -> C) on the TP group.

    "ring" / "builtin": our `ParallelMLP` with from-scratch ring or torch.distributed
    collectives; "dtensor": torch's `ColwiseParallel` / `RowwiseParallel` on the same
    weights. Rounds interleave the implementations (other programs' noise hits all
    alike); each call starts after a barrier; round 0 warms up. Returns
    {"median": {impl: s}, "ratio": {impl: t_impl / t_dtensor}} (time ours / DTensor, lower is better).
    Launch with `check_shapes=False` to time the algorithms alone.
    """
    import copy
    import statistics
    import time

    import torch.distributed as dist

    from parallel_lab.runtime import device as mesh
    from parallel_lab.tensor_parallel import ParallelMLP

    mlp = build_model(GPTConfig(d_model=d_model, n_heads=1), ctx.seed).blocks[0].mlp.to(ctx.device)
    models = {}
    for impl in impls:
        if impl == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            dmesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
            plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
            models[impl] = parallelize_module(copy.deepcopy(mlp), dmesh, plan)
        else:
            models[impl] = ParallelMLP.from_mlp(ctx, mlp, impl=impl)
    x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    times: dict[str, list[float]] = {k: [] for k in impls}
    for i in range(repeats + 1):
        for name, m in models.items():
            xi = x.clone().requires_grad_()
            dist.barrier()
            mesh.synchronize(ctx.device)
            t0 = time.perf_counter()
            m(xi).sum().backward()
            mesh.synchronize(ctx.device)
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: med[k] / med["dtensor"] for k in impls} if "dtensor" in impls else {}
    return {"median": med, "ratio": ratio}


def report(values: list[dict], batch: int, seq: int, d_model: int) -> tuple[str, bool]:
    """One row per rank; ok when every diff is inside its tolerance and bytes equal the formula."""
    lines = [f"{'rank':>4} {'params':>8} {'|dloss|':>9} {'max|dgrad|':>10} {'max|dparam|':>11} "
             f"{'layer bytes':>11} {'formula':>8}"]  # fmt: skip
    ok = True
    for r, v in enumerate(values):
        good = (v["loss_diff"] <= LOSS_TOL and v["grad_diff"] <= GRAD_TOL and v["param_diff"] <= PARAM_TOL
                and v["layer_bytes"] == v["layer_formula"])  # fmt: skip
        ok &= good
        lines.append(
            f"{r:>4} {v['params_here']:>8} {v['loss_diff']:>9.2e} {v['grad_diff']:>10.2e} {v['param_diff']:>11.2e} "
            f"{v['layer_bytes']:>11} {v['layer_formula']:>8}" + ("" if good else "  <- differs")
        )
    lines.append(f"per-layer volume 8·b·s·h (Korthikanti et al. 2022) = {8 * batch * seq * d_model} elements "
                 f"(= {8 * batch * seq * d_model * 4} B in fp32; a ring moves (p-1)/p of it per rank)")  # fmt: skip
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 16, or the world size if larger)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=None, help="heads (default 4, or one per rank if more)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--sequence-parallel", action="store_true", help="LayerNorm/residual on s/tp tokens per rank"
    )
    ap.add_argument("--regather", action="store_true", help="with SP: keep only the shard, all-gather again")
    ap.add_argument("--impl", default="ring", choices=["ring", "builtin"])
    ap.add_argument("--trace", default="runs/tensor_parallel.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    world = script_world(args.nproc)
    args.heads = scaled_default("--heads", args.heads, world, lambda w: max(4, w))
    args.seq = scaled_default("--seq", args.seq, world, lambda w: round_up(16, w))
    kw = dict(steps=args.steps, batch=args.batch, seq=args.seq, d_model=args.d_model, heads=args.heads,
              layers=args.layers, sequence_parallel=args.sequence_parallel, regather=args.regather,
              impl=args.impl)  # fmt: skip
    result = run_script(run_tensor_parallel, nproc=args.nproc, trace_path=args.trace, **kw)
    if result is None:  # not rank 0
        return 0
    table, ok = report(result.values, args.batch, args.seq, args.d_model)
    mode = "tensor + sequence parallel" if args.sequence_parallel else "tensor parallel"
    print(
        f"{result.world_size} ranks ({result.backend}), {mode}, {args.steps} SGD-momentum steps, impl={args.impl}"
    )
    print(table)
    print("matches the single-process model" if ok else "DIFFERS from the single-process model")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
