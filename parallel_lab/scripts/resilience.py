"""Lesson 13 as a script: a training run that loses a rank, is restarted, and resumes exactly.

    torchrun --nproc-per-node 2 --max-restarts 1 -m parallel_lab.scripts.resilience --kill 1:5
    accelerate launch --config_file parallel_lab/configs/accelerate_cpu.yaml --num_processes 2 \\
        --max_restarts 1 -m parallel_lab.scripts.resilience --kill 1:5
    python -m parallel_lab.scripts.resilience --kill 1:5      # no launcher: 2 local ranks, restarted by the lab

ZeRO-1 data parallelism on a tiny MLP (`parallel_lab.resilience.train_resilient`), a checkpoint
every `--every` steps under `--root` (atomic files, manifest last). `--kill R:S` makes rank R
SIGKILL itself at the start of step S in the first attempt; the launcher's elastic agent
(torchrun `--max-restarts`, which accelerate passes through) restarts every rank, and they resume
from the newest complete checkpoint. Rank 0 then checks the whole loss history against one process
training on the same batches, and says which step the run resumed from. Without a launcher,
`--shrink` restarts on one rank fewer (4 -> 3), as when a machine is gone for good.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from parallel_lab.resilience import (
    ResilientConfig,
    latest,
    reference_losses,
    run_with_restarts,
    train_resilient,
)
from parallel_lab.runtime.from_env import round_up, run_from_env, save_trace, scaled_default

TOL = 1e-5  # relative: the ranks sum their gradients in another order than one process does


def _kill(text: str) -> tuple[int, int]:
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kill takes RANK:STEP, e.g. 1:5, got {text!r}") from None
    return rank, step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    ap.add_argument("--kill", type=_kill, default=None, help="RANK:STEP that dies in the first attempt")
    ap.add_argument(
        "--root", default="runs/resilience", help="checkpoint folder (emptied at the first attempt)"
    )
    ap.add_argument("--trace", default="runs/resilience.json", help="where rank 0 writes the trace")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (default 12, or the next multiple of the ranks above 4)")  # fmt: skip
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    ap.add_argument("--max-restarts", type=int, default=1, help="without a launcher: restarts allowed")
    ap.add_argument("--shrink", action="store_true", help="without a launcher: restart on one rank fewer")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error(f"--steps and --every must be >= 1, got {args.steps} and {args.every}")
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    batch = scaled_default("--batch", args.batch, world, lambda w: 12 if 12 % w == 0 else round_up(12, w))
    if batch % world or (args.shrink and batch % (world - 1)):
        ap.error(f"the global batch ({batch}) must divide by the number of ranks ({world})"
                 + (f" and by {world - 1} after shrinking" if args.shrink else ""))  # fmt: skip
    if args.kill is not None and not (0 <= args.kill[0] < world and 0 <= args.kill[1] < args.steps):
        ap.error(
            f"--kill {args.kill[0]}:{args.kill[1]}: the rank must be below {world}, the step below {args.steps}"
        )
    cfg = ResilientConfig(
        root=args.root, steps=args.steps, checkpoint_every=args.every, kill=args.kill, global_batch=batch
    )
    if "RANK" in os.environ:  # under a launcher: its agent restarts us; the count says which attempt this is
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0 and os.environ["RANK"] == "0":
            shutil.rmtree(args.root, ignore_errors=True)  # a fresh run (the others wait in the rendezvous)
        result = run_from_env(train_resilient, cfg, attempt=attempt, trace_path=args.trace)
        if result is None:
            return 0
        history, restarts = result.values[0], attempt
    else:
        shutil.rmtree(args.root, ignore_errors=True)
        run = run_with_restarts(
            train_resilient, args.nproc, cfg, max_restarts=args.max_restarts, shrink=args.shrink
        )
        result = run.attempts[-1].result
        result.timeline = run.timeline()
        save_trace(result, args.trace)
        history, restarts = result.values[0], run.restarts
        for a in run.attempts[:-1]:
            print(f"attempt on {a.world_size} ranks failed: {a.error}")
    ref = reference_losses(cfg)
    ok = len(history["loss"]) == len(ref) and all(
        abs(a - b) <= TOL * abs(b) + 1e-7 for a, b in zip(history["loss"], ref)
    )
    _, manifest, _ = latest(args.root)
    resumed = [e["name"] for e in result.timeline if e["name"].startswith("resumed")]
    print(f"{result.world_size} ranks ({result.backend}), {args.steps} steps, a checkpoint every {args.every}; "
          f"restarts: {restarts}; {resumed[0] if resumed else 'never resumed'}")  # fmt: skip
    print("step  loss        one process")
    for i, (a, b) in enumerate(zip(history["loss"], ref)):
        print(f"{i:>4}  {a:.8f}  {b:.8f}")
    print(
        f"last checkpoint: step {manifest['step'] if manifest else '-'} on {manifest['world_size'] if manifest else '-'} ranks"
    )
    print("losses match single-process training" if ok else "losses DIFFER from single-process training")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
