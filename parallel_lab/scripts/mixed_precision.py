"""Mixed-precision data-parallel training of a tiny GPT: fp16/bf16 weights, fp32 masters, dynamic loss scale.

Every rank trains on its slice of each global batch; the overflow flag is
all-reduced so all ranks skip the same steps (`--overflow-at` plants an inf in one
rank's gradients to show it). Runs from a notebook through
`parallel_lab.runtime.launch(train_mixed, 2, RunConfig(...))` or from a terminal:

    torchrun --nproc-per-node 2 -m parallel_lab.scripts.mixed_precision --overflow-at 5
    torchrun --nproc-per-node 2 -m parallel_lab.scripts.mixed_precision --checkpoint-segments 2
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m parallel_lab.scripts.mixed_precision
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from parallel_lab.checkpointing import gpt_forward
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.precision import MixedPrecisionConfig, MixedPrecisionOptimizer, has_overflow
from parallel_lab.runtime.from_env import run_script


@dataclass
class RunConfig:
    """One training run: the model, the recipe, and where to plant overflows."""

    dtype: str = "fp16"
    loss_scale: str | float = "dynamic"
    init_scale: float = 2.0**16
    growth_interval: int = 10
    steps: int = 40
    batch: int = 16  # global batch; each rank takes batch / world_size rows
    lr: float = 3e-3
    optimizer: str = "adam"
    overflow_at: tuple[int, ...] = ()  # steps where `overflow_rank` finds an inf in its gradients
    overflow_rank: int = -1  # -1: the last rank
    checkpoint_segments: int | None = None  # lesson 07: run the blocks through checkpoint_sequential
    model: GPTConfig = field(default_factory=lambda: GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4))


def train_mixed(ctx, cfg: RunConfig | None = None) -> dict:
    """Train; return this rank's losses, scale history, skipped steps and a checksum of the weights."""
    cfg = cfg or RunConfig()
    if cfg.batch % ctx.world_size:
        raise ValueError(f"batch ({cfg.batch}) must be divisible by the number of ranks ({ctx.world_size})")
    model = build_model(cfg.model, seed=ctx.seed).to(ctx.device)  # same weights on every rank
    mp = MixedPrecisionConfig(dtype=cfg.dtype, loss_scale=cfg.loss_scale, init_scale=cfg.init_scale,
                              growth_interval=cfg.growth_interval)  # fmt: skip
    opt = MixedPrecisionOptimizer(model, cfg.optimizer, cfg.lr, mp, ctx=ctx)
    bad_rank = cfg.overflow_rank % ctx.world_size
    per = cfg.batch // ctx.world_size
    rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
    out: dict = {"loss": [], "scale": [], "skipped": [], "local_inf": []}
    for step in range(cfg.steps):
        x, y = synthetic_batch(
            "tokens", cfg.batch, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab, seed=step
        )
        x, y = x[rows].to(ctx.device), y[rows].to(ctx.device)  # (B/N, T): this rank's slice
        opt.zero_grad()
        with ctx.span(f"forward {step}", "compute"):
            logits = gpt_forward(model, x, segments=cfg.checkpoint_segments, ctx=ctx)  # (B/N, T, V), 16-bit
            # The loss in fp32: a softmax over the vocabulary is where 16 bits lose the most.
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        with ctx.span(f"backward {step}", "compute"):
            opt.backward(loss)
        if step in cfg.overflow_at and ctx.rank == bad_rank:
            opt.params[0].grad.view(-1)[0] = float("inf")  # one rank's gradient overflows
        out["local_inf"].append(has_overflow(p.grad for p in opt.params))  # this rank's own verdict
        out["scale"].append(opt.scaler.get_scale())
        out["skipped"].append(not opt.step())
        out["loss"].append(loss.item())
    with torch.no_grad():
        out["checksum"] = sum(p.double().sum().item() for p in model.parameters())
    out["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--loss-scale", default="dynamic", help="'dynamic', 'none' or a number")
    ap.add_argument("--init-scale", type=float, default=2.0**16)
    ap.add_argument("--growth-interval", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--overflow-at", type=int, nargs="*", default=[], help="steps where the last rank overflows"
    )
    ap.add_argument("--checkpoint-segments", type=int, default=None, help="checkpoint the blocks (lesson 07)")
    ap.add_argument("--trace", default="runs/mixed_precision.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    ls = args.loss_scale if args.loss_scale in ("dynamic", "none") else float(args.loss_scale)
    cfg = RunConfig(dtype=args.dtype, loss_scale=ls, init_scale=args.init_scale,
                    growth_interval=args.growth_interval, steps=args.steps, overflow_at=tuple(args.overflow_at), checkpoint_segments=args.checkpoint_segments)  # fmt: skip
    result = run_script(train_mixed, cfg, nproc=args.nproc, trace_path=args.trace)
    if result is None:  # not rank 0
        return 0
    v = result.values
    skipped = [i for i, s in enumerate(v[0]["skipped"]) if s]
    same = all(r["skipped"] == v[0]["skipped"] and r["scale"] == v[0]["scale"] for r in v)
    same_w = len({round(r["checksum"], 9) for r in v}) == 1
    print(
        f"{result.world_size} ranks ({result.backend}), {args.dtype} weights, fp32 masters, loss scale {args.loss_scale}"
    )
    print(f"loss {v[0]['loss'][0]:.4f} -> {v[0]['loss'][-1]:.4f} in {args.steps} steps")
    print(f"scale {v[0]['scale'][0]:g} -> {v[0]['scale'][-1]:g}; skipped steps {skipped}")
    print(f"all ranks skipped the same steps with the same scale: {same}; identical weights: {same_w}")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if same and same_w else 1


if __name__ == "__main__":
    raise SystemExit(main())
