"""Lesson 18 as a script: data-parallel training with a compressed gradient all-reduce (a DDP comm hook).

    torchrun --nproc-per-node 2 -m parallel_lab.scripts.fewer_bytes --hook powersgd --rank 2
    accelerate launch --config_file parallel_lab/configs/accelerate_cpu.yaml --num_processes 2 \\
        -m parallel_lab.scripts.fewer_bytes --hook fp16
    python -m parallel_lab.scripts.fewer_bytes --hook topk --ratio 0.01     # no launcher: 2 local ranks

Each rank trains a TinyGPT on its own batches with `BucketedDDP(comm="ring", hook=...)`, and, in the
same run, a second copy with the plain float32 all-reduce. Rank 0 prints the bytes each rank sent per
step next to the formula (`hook_bytes_per_rank`), the loss of both runs, and checks that every rank
holds the same weights; the trace (`--trace`) loads with `RunResult.load`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from parallel_lab.data_parallel import BucketedDDP, CastCompression, PowerSGD, TopK, hook_bytes_per_rank
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.runtime.from_env import run_script, script_world

HOOKS = ("none", "fp16", "bf16", "powersgd", "topk")


def make_hook(name: str, rank: int, ratio: float, error_feedback: bool):
    return {"none": lambda: None, "fp16": lambda: CastCompression(torch.float16),
            "bf16": lambda: CastCompression(torch.bfloat16), "powersgd": lambda: PowerSGD(rank, error_feedback),
            "topk": lambda: TopK(ratio, error_feedback)}[name]()  # fmt: skip


def train_rank(ctx, cfg: GPTConfig, hook_args: tuple, steps: int, batch: int, lr: float) -> dict:
    out = {}
    for which in ("plain", "hook"):
        model = build_model(cfg, 0).to(ctx.device)
        hook = make_hook(*hook_args) if which == "hook" else None
        ddp = BucketedDDP(model, ctx, bucket_bytes=2**30, comm="ring", hook=hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses, sent = [], []
        for s in range(steps):
            x, y = (t.to(ctx.device) for t in synthetic_batch("tokens", batch, seq_len=cfg.seq_len, vocab=cfg.vocab,
                                                              seed=1000 * s + ctx.rank))  # fmt: skip
            with ctx.recorder.span(f"{which} step", kind="compute"):
                loss = ddp(x, y)
                opt.zero_grad(set_to_none=False)
                before = ctx.recorder.comm_totals()["sent"]
                loss.backward()
                ddp.finish_gradient_sync()
                sent.append(ctx.recorder.comm_totals()["sent"] - before)
                opt.step()
            losses.append(loss.item())
        out[which] = {"losses": losses, "sent": sent, "params": [p.detach().cpu().clone() for p in model.parameters()],
                      "formula": hook_bytes_per_rank(hook, ddp.buckets, ctx.world_size, ctx.rank)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hook", choices=HOOKS, default="powersgd")
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD's rank r")
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k: the fraction of entries sent")
    ap.add_argument(
        "--no-error-feedback", action="store_true", help="PowerSGD / top-k without error feedback"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--trace", default="runs/fewer_bytes.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    if args.rank < 1 or not 0 < args.ratio <= 1 or args.steps < 1 or args.batch < 1:
        ap.error(f"--rank ({args.rank}) >= 1, 0 < --ratio ({args.ratio}) <= 1, --steps and --batch >= 1")
    cfg = GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    hook_args = (args.hook, args.rank, args.ratio, not args.no_error_feedback)
    result = run_script(train_rank, cfg, hook_args, args.steps, args.batch, args.lr, nproc=world,
                        trace_path=args.trace, threads=1)  # fmt: skip
    if result is None:  # not rank 0
        return 0
    vals = result.values
    plain, hooked = vals[0]["plain"], vals[0]["hook"]
    print(
        f"{world} ranks ({result.backend}), hook {args.hook}: TinyGPT, {args.steps} SGD steps, batch {args.batch} per rank"
    )
    print(f"{'rank':>4} {'sent per step (B)':>18} {'formula (B)':>12} {'/ fp32 all-reduce':>18}")
    bytes_ok = True
    for r, v in enumerate(vals):
        h = v["hook"]
        bytes_ok &= all(s == h["formula"] for s in h["sent"])
        dense = v["plain"]["sent"][-1]  # 0 at one rank: nothing to send, no ratio
        ratio = f"{h['sent'][-1] / dense:>17.3f}x" if dense else f"{'-':>18}"
        print(f"{r:>4} {h['sent'][-1]:>18,} {h['formula']:>12,} {ratio}")
    print(
        f"loss after {args.steps} steps: {hooked['losses'][-1]:.4f} with the hook, {plain['losses'][-1]:.4f} without"
    )
    same = all(torch.equal(a, b) for v in vals[1:] for a, b in zip(v["hook"]["params"], hooked["params"]))
    print("bytes equal the formula" if bytes_ok else "BYTES DIFFER from the formula")
    print("every rank holds the same weights" if same else "RANKS DIFFER")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if bytes_ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
