"""Lesson 04 as a script: train a tiny GPT under ZeRO stage 0-3 and check bytes against the formulas.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.zero --stage 3
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.zero --stage 3
    python -m parallel_lab.scripts.zero --stage 3 --nproc 4     # no launcher: local ranks via parallel_lab.runtime.launch
    torchrun --nproc-per-node 4 -m parallel_lab.scripts.zero --stage 3 --replicate 2   # HSDP: 2 replicas x 2 shards

Every rank trains its own slice of the data (seed + rank). Rank 0 prints, per rank: the
model-state bytes it holds next to `costmodel.model_state_bytes` (plus the flat buffer's
padding, see zero.meta), the bytes it sent per step next to the formula (ring all-reduce
of the padded buffer; 1.5x that at stage 3), and whether every rank ends with identical
weights. The trace (`--trace`, default runs/zero.json) loads back with `RunResult.load`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import torch

from parallel_lab import comms
from parallel_lab.models import GPTConfig, build_model, compute_loss, synthetic_batch
from parallel_lab.offload import ZeroOffload, offload_state_bytes
from parallel_lab.runtime.from_env import run_script
from parallel_lab.runtime.memory_state import attach_hooks
from parallel_lab.zero import HSDP, HSDPMesh, ZeRO, expected_state_bytes


def comm_formula(
    numel: int, padded: int, world_size: int, stage: int, itemsize: int, replicate: int = 1
) -> list[tuple[int, int]]:
    """(sent, recv) bytes per rank per step: a ring all-reduce of Ψ (stage 0) or of the padded P
    elements (stages 1-2: reduce-scatter + all-gather); stage 3 adds a second all-gather: 1.5x.
    HSDP (`replicate` R > 1, stage 3, lesson 20): stage 3's bytes over the shard group of S = N/R
    ranks, plus a ring all-reduce of the (P/S,) slice over the R replicas; rank = replica x S + s."""
    shard_ranks = world_size // replicate
    n = numel if stage == 0 else padded
    rows = comms.ring_bytes_per_rank(n, shard_ranks, itemsize, "all_reduce")
    if stage == 3:
        rows = [(3 * s // 2, 3 * r // 2) for s, r in rows]
    if replicate == 1:
        return rows
    across = comms.ring_bytes_per_rank(padded // shard_ranks, replicate, itemsize, "all_reduce")
    return [
        tuple(a + b for a, b in zip(rows[k % shard_ranks], across[k // shard_ranks]))
        for k in range(world_size)
    ]


def full_params(zero) -> dict[str, torch.Tensor]:
    """Every parameter's full value by name (stage 3 gathers them: call on every rank)."""
    if hasattr(zero, "full_parameters"):
        return zero.full_parameters()
    return {n: p.detach().clone() for n, p in zero.model.named_parameters(remove_duplicate=False)}


def zero_train(
    ctx, stage: int = 3, steps: int = 3, batch: int = 4, d_model: int = 64, n_layers: int = 4,
    seq_len: int = 16, vocab: int = 64, n_heads: int = 4, precision: str = "fp32", lr: float = 1e-2,
    prefetch: bool = True, layer_samples: bool = True, offload: bool = False, replicate: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Train a TinyGPT for `steps` ZeRO steps on this rank's `batch` sequences; return a summary.

    With memory tracked, `layer_samples` adds a memory sample after every layer's forward
    and backward, so the plot shows gradients and gathered parameters come and go.
    `offload=True` (stage 2 only) runs `offload.ZeroOffload`: Adam on the host; the summary
    then also holds the host's memory samples and the bytes that crossed each way.
    """
    if offload and stage != 2:
        raise ValueError(f"offload runs on ZeRO stage 2 (its optimizer moves to the host), got stage={stage}")
    if replicate > 1 and (stage != 3 or ctx.world_size % replicate):
        raise ValueError(f"replicate={replicate} is HSDP: needs stage 3 and a world size it divides, "
                         f"got stage={stage}, world size {ctx.world_size}")  # fmt: skip
    cfg = GPTConfig(vocab=vocab, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
    model = build_model(cfg, seed=ctx.seed, device=ctx.device)  # the same weights on every rank
    extra = {"prefetch": prefetch} if stage == 3 else {}
    if offload:
        zero = ZeroOffload(ctx, model, optimizer="adam", precision=precision, lr=lr)
    elif replicate > 1:
        groups = HSDPMesh(replicate, ctx.world_size // replicate).build(ctx)
        zero = HSDP(ctx, model, groups, optimizer="adam", precision=precision, lr=lr, prefetch=prefetch)
    else:
        zero = ZeRO(ctx, model, stage=stage, optimizer="adam", precision=precision, lr=lr, **extra)
    if ctx.memory is not None and layer_samples:
        attach_hooks(model, ctx.recorder)
    x, y = synthetic_batch("tokens", batch, seq_len=seq_len, vocab=vocab, seed=ctx.seed + 1 + ctx.rank,
                           device=ctx.device)  # fmt: skip
    losses = []
    for step in range(steps):
        # Stage 3 draws one span per block (forward/backward); whole-pass spans would cover them.
        with ctx.span(f"forward {step}") if stage < 3 else contextlib.nullcontext():
            loss = compute_loss(model, x, y)
        with ctx.span(f"backward {step}") if stage < 3 else contextlib.nullcontext():
            loss.backward()
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    lay = zero.layout
    comm = ctx.recorder.comm_totals()  # the training steps' bytes (full_params below gathers more)
    live = ctx.memory.snapshot() if ctx.memory is not None else None  # after the last step
    params = full_params(zero)
    if offload:
        expected = offload_state_bytes(lay.numel, ctx.world_size, precision)
    else:
        expected = expected_state_bytes(lay, stage, "adam", precision)
    out = {
        "stage": stage,
        "losses": losses,
        "numel": lay.numel,
        "padded": lay.padded,
        "shard": lay.shard,
        "state_bytes": zero.state_bytes(),
        "expected": expected,
        "comm": comm,
        "formula": comm_formula(
            lay.numel, lay.padded, ctx.world_size, stage, zero.states.shard.element_size(), replicate
        ),
        "replicate": replicate,
        "checksum": float(sum(p.double().sum() for p in params.values())),
        "live": live,
        "peak": ctx.memory.peak() if ctx.memory is not None else None,
    }
    if offload:
        out.update(host_samples=zero.host.samples, host_live=zero.host.tracker.snapshot(),
                   transfer=dict(zero.transfer_bytes))  # fmt: skip
    return out


def report(values: list[dict], steps: int) -> tuple[str, bool]:
    """One row per rank: state bytes vs expected, bytes sent per step vs formula; and overall verdict."""
    lines = [f"{'rank':>4} {'param B':>10} {'grad B':>10} {'optim B':>10} {'= expected':>10} "
             f"{'sent/step B':>12} {'formula':>10}"]  # fmt: skip
    ok = len({v["checksum"] for v in values}) == 1
    for r, v in enumerate(values):
        sb, ex = v["state_bytes"], v["expected"]
        same = sb == ex
        if "device" in sb:  # offload: device and host, summed per category for the row
            sb = {k: sb["device"][k] + sb["host"][k] for k in ("param", "grad", "optim")}
        sent = v["comm"]["sent"]
        f_sent = v["formula"][r][0] * steps
        ok &= same and sent == f_sent
        lines.append(f"{r:>4} {sb['param']:>10,} {sb['grad']:>10,} {sb['optim']:>10,} {str(same):>10} "
                     f"{sent // steps:>12,} {f_sent // steps:>10,}")  # fmt: skip
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stage", type=int, default=None, choices=(0, 1, 2, 3), help="default 3 (2 with --offload)"
    )
    ap.add_argument(
        "--offload", action="store_true", help="ZeRO-Offload: Adam and the fp32 master on the host"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "mixed"))
    ap.add_argument("--no-prefetch", action="store_true", help="stage 3: gather each block only when needed")
    ap.add_argument("--replicate", type=int, default=1,
                    help="stage 3: HSDP with R replicas of world/R sharded ranks each (lesson 20)")  # fmt: skip
    ap.add_argument("--trace", default="runs/zero.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    if args.stage is None:
        args.stage = 2 if args.offload else 3
    if args.offload and args.stage != 2:
        ap.error("--offload runs on ZeRO stage 2: use --stage 2 (or leave --stage out)")
    if args.replicate < 1 or (args.replicate > 1 and args.stage != 3):
        ap.error(f"--replicate {args.replicate}: HSDP shards with ZeRO stage 3 (use --stage 3), R >= 1")
    kw = dict(stage=args.stage, offload=args.offload, steps=args.steps, batch=args.batch, d_model=args.d_model, n_layers=args.layers,
              precision=args.precision, prefetch=not args.no_prefetch, replicate=args.replicate)  # fmt: skip
    result = run_script(zero_train, nproc=args.nproc, trace_path=args.trace, track_memory=True, **kw)
    if result is None:  # not rank 0
        return 0
    v0 = result.values[0]
    what = "ZeRO-Offload (stage 2, Adam on the host)" if args.offload else f"ZeRO stage {args.stage}"
    if args.replicate > 1:
        what = (
            f"HSDP: {args.replicate} replicas x {result.world_size // args.replicate} shards (ZeRO-3 inside)"
        )
    print(f"{what}, {result.world_size} ranks ({result.backend}), {args.precision}: "
          f"Ψ = {v0['numel']:,} trainable parameters, S = {v0['shard']:,} per rank, padded P = {v0['padded']:,}")  # fmt: skip
    table, ok = report(result.values, args.steps)
    print(table)
    print(f"losses on rank 0: {', '.join(f'{x:.4f}' for x in v0['losses'])}")
    if args.offload:
        t = v0["transfer"]
        print(f"rank 0 moved {t['d2h'] // args.steps:,} B of gradients to the host and {t['h2d'] // args.steps:,} B "
              f"of weights back per step (S = {v0['shard']:,} elements each way)")  # fmt: skip
    print("identical weights on every rank; bytes equal the formulas" if ok else "MISMATCH (see the table)")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
