"""Lesson 09 as a script: train a pipelined TinyMLP with one schedule and report its bubble.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.pipeline --schedule 1f1b
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.pipeline --schedule 1f1b
    python -m parallel_lab.scripts.pipeline --schedule interleaved --chunks 2   # no launcher: 4 local ranks
    python -m parallel_lab.scripts.pipeline --schedule zb-v   # two chunks per rank in a V (also dualpipev)

With `--dp 2` the ranks form DP x PP (2 replicas of a 2-stage pipeline on 4 ranks).
`--compute-time` pads each stage's forward of one micro-batch to that many seconds
(backward 2x), an emulated device speed that makes compute dominate message latency
on a busy CPU. Rank 0 prints the losses next to single-process training, the
measured bubble next to (p-1)/(v*m + p-1), the bytes each rank sent, and writes the
trace (`--trace`, default runs/pipeline.json) that `RunResult.load` reads back.
"""

from __future__ import annotations

import argparse
import sys

from parallel_lab.costmodel import pipeline_bubble_fraction
from parallel_lab.models import build_model, train_reference
from parallel_lab.pipeline import (
    SCHEDULES,
    V_SCHEDULES,
    PipelineConfig,
    chunks_of,
    make_schedule,
    measured_bubble,
    placement_of,
    reference_batches,
    simulate,
    train_pipeline,
)
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world
from parallel_lab.runtime.parallel_dims import ParallelDims


def report(result, cfg: PipelineConfig, dims: ParallelDims) -> tuple[str, bool]:
    """Losses against single-process training, the bubble against the formula, bytes per rank."""
    model = build_model(cfg.model_config, seed=cfg.seed)
    ref = train_reference(model, reference_batches(cfg), cfg.optimizer, cfg.lr, cfg.steps)
    last = [v for v in result.values if v["losses"] is not None]
    losses = [sum(v["losses"][i] for v in last) / len(last) for i in range(cfg.steps)]
    ok = max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5
    p, m = dims.pp, cfg.microbatches
    v = chunks_of(cfg.schedule, cfg.chunks)
    m = 1 if cfg.schedule == "naive" else m
    lines = [f"{'step':>4} {'pipeline loss':>14} {'single-process':>15}"]
    lines += [f"{i:>4} {a:>14.6f} {b:>15.6f}" for i, (a, b) in enumerate(zip(losses, ref))]
    bubble = min(measured_bubble(result, s) for s in range(cfg.steps))
    if cfg.schedule.startswith("zb-") or cfg.schedule in V_SCHEDULES:  # split: F, B and W timed alike
        sched, where = make_schedule(cfg.schedule, p, m, v), placement_of(cfg.schedule)
        sim = simulate(sched, t_f=1.0, t_b=1.0, t_w=1.0, chunks=v, placement=where)
        lines.append(
            f"bubble: measured {bubble:.1%} (best step), simulated with equal F, B and W times "
            f"{sim.bubble_fraction:.1%}; 1F1B's formula (p-1)/(m + p-1) = {pipeline_bubble_fraction(p, m, 1):.1%}"
        )
    else:
        lines.append(
            f"bubble: measured {bubble:.1%} (best step), formula (p-1)/(v*m + p-1) = "
            f"{pipeline_bubble_fraction(p, m, v):.1%}; Megatron's bubble/compute (p-1)/(v*m) = {(p - 1) / (v * m):.1%}"
        )
    for r, c in enumerate(result.comm_bytes):
        lines.append(
            f"rank {r}: sent {c['sent']:,} B "
            + ", ".join(f"{k} {d['sent']:,}" for k, d in c["by_op"].items())
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument(
        "--chunks", type=int, default=2, help="model chunks per rank (interleaved; zb-v and dualpipev: 2)"
    )
    ap.add_argument("--layers", type=int, default=None, help="default 8, or a multiple of the stages")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (pp = world size / dp)")
    ap.add_argument(
        "--compute-time", type=float, default=0.02, help="seconds per stage forward (0: as fast as it runs)"
    )
    ap.add_argument("--trace", default="runs/pipeline.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    if args.dp < 1 or world % args.dp:
        ap.error(f"--dp {args.dp} must divide the world size {world}")
    per_rank = chunks_of(args.schedule, args.chunks)  # model chunks per stage rank
    args.layers = scaled_default(
        "--layers", args.layers, world, lambda w: round_up(8, w // args.dp * per_rank)
    )
    micro = 1 if args.schedule == "naive" else args.microbatches
    try:
        cfg = PipelineConfig(schedule=args.schedule, microbatches=micro, chunks=per_rank,
                             layers=args.layers, hidden=args.hidden, batch=args.batch, steps=args.steps,
                             compute_time=args.compute_time)  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    dims = ParallelDims(dp=args.dp, pp=world // args.dp, world_size=world)
    result = run_script(train_pipeline, cfg, dims, nproc=world, trace_path=args.trace, threads=1)
    if result is None:  # not rank 0
        return 0
    table, ok = report(result, cfg, dims)
    print(f"{world} ranks ({result.backend}): dp={dims.dp} x pp={dims.pp}, schedule {cfg.schedule}, m={cfg.microbatches}"
          + (f", v={cfg.chunks}" if cfg.schedule == "interleaved" else ""))  # fmt: skip
    print(table)
    print("losses match single-process training" if ok else "LOSSES DIFFER from single-process training")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
