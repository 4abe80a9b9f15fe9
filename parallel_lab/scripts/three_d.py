"""Lesson 10 as a script: a TinyGPT on a DP x TP x PP mesh, checked against single-process training.

    torchrun --nproc-per-node 8 -m parallel_lab.scripts.three_d --dp 2 --tp 2 --pp 2
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 8 -m parallel_lab.scripts.three_d --dp 2 --tp 2 --pp 2
    python -m parallel_lab.scripts.three_d                 # no launcher: 8 local ranks, 2 x 2 x 2

Rank 0 prints the mesh's groups, the largest difference to single-process training
(losses, step-0 gradients against each shard's slice, final parameters), the memory
each rank measured next to the planner's prediction, the bytes each rank sent per
operation, and writes the trace (`--trace`, default runs/three_d.json).
"""

from __future__ import annotations

import argparse
import os
import sys

from parallel_lab.costmodel import lab_stage_memory
from parallel_lab.models import GPTConfig
from parallel_lab.pipeline import SCHEDULES
from parallel_lab.runtime.from_env import run_script
from parallel_lab.runtime.parallel_dims import ParallelDims
from parallel_lab.three_d import ThreeDConfig, compare_3d, train_3d


def report(result, cfg: ThreeDConfig, dims: ParallelDims) -> tuple[str, bool]:
    """Parity with single-process training, and memory measured vs the planner, per rank."""
    diff = compare_3d(result, cfg)
    ok = (
        diff["loss"] < 1e-5
        and diff["grad"] < 1e-5
        and diff["param"] < (1e-3 if cfg.optimizer == "adam" else 1e-5)
    )
    lines = [f"groups: tp {dims.groups('tp')}, dp {dims.groups('dp')}, pp {dims.groups('pp')}",
             "max |difference| to single-process: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items())]  # fmt: skip
    if result.memory:
        peaks: dict[int, int] = {}
        for s in result.memory:
            peaks[s["rank"]] = max(peaks.get(s["rank"], 0), sum(s["bytes"].values()))
        mb = cfg.batch // dims.dp // cfg.microbatches
        lines.append(
            f"{'rank':>4} {'(pp, dp, tp)':>13} {'measured peak B':>16} {'planner B':>10} {'error':>7}"
        )
        for v in result.values:
            c = v["coords"]
            pred = lab_stage_memory(cfg.gpt, dims, mb, cfg.microbatches, c["pp"], cfg.optimizer)["total"]
            got = peaks[v["rank"]]
            lines.append(
                f"{v['rank']:>4} {str((c['pp'], c['dp'], c['tp'])):>13} {got:>16,} {pred:>10,} {(pred - got) / got:>+7.1%}"
            )
    for r, c in enumerate(result.comm_bytes):
        lines.append(
            f"rank {r}: sent {c['sent']:,} B: "
            + ", ".join(f"{k} {d['sent']:,}" for k, d in c["by_op"].items() if d["sent"])
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=None, help="default: world size / (tp x pp), else 2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip memory tracking (faster)")
    ap.add_argument("--trace", default="runs/three_d.json", help="where rank 0 writes the trace")
    args = ap.parse_args(argv)
    if args.dp is None:  # under a launcher the world size decides; run plainly, 2 x 2 x 2
        launched = os.environ.get("WORLD_SIZE")
        args.dp = int(launched) // (args.tp * args.pp) if launched else 2
        if args.dp != 2 and os.environ.get("RANK", "0") == "0":
            print(f"--dp {args.dp}: the default scaled to {launched} ranks", flush=True)
    world = int(os.environ.get("WORLD_SIZE", args.dp * args.tp * args.pp))
    try:
        dims = ParallelDims(dp=args.dp, tp=args.tp, pp=args.pp, world_size=world)
        gpt = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=args.layers)
        cfg = ThreeDConfig(gpt=gpt, schedule=args.schedule, microbatches=args.microbatches, batch=16,
                           steps=args.steps, optimizer="sgd", lr=0.1)  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    track = not args.no_memory
    result = run_script(train_3d, cfg, dims, nproc=world, trace_path=args.trace, track_memory=track, threads=1,
                            timeout=300)  # fmt: skip
    if result is None:  # not rank 0
        return 0
    table, ok = report(result, cfg, dims)
    print(
        f"{world} ranks ({result.backend}): dp={dims.dp} x tp={dims.tp} x pp={dims.pp}, {cfg.schedule}, m={cfg.microbatches}"
    )
    print(table)
    print("matches single-process training" if ok else "DIFFERS from single-process training")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
