"""The tour's first distributed program: a few data-parallel steps of a tiny MLP.

Every rank computes on its own slice of the batch and the gradients are averaged
with one all-reduce per step, so all ranks keep identical weights. Runs from a
notebook through `parallel_lab.runtime.launch(tour_steps, 4)` or from a terminal:

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.tour
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.tour
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn


def tour_steps(ctx, steps: int = 3, batch: int = 64, hidden: int = 256) -> dict:
    """Train a 2-layer MLP for `steps` data-parallel steps; return this rank's last loss and a weight checksum."""
    torch.manual_seed(ctx.seed)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, 1)).to(ctx.device)
    if ctx.memory is not None:
        ctx.memory.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.randn(batch, 32, generator=gen)  # (B, 32), the global batch
        y = x[:, :1] * 2.0  # (B, 1)
        shard = slice(ctx.rank * batch // ctx.world_size, (ctx.rank + 1) * batch // ctx.world_size)
        xs, ys = x[shard].to(ctx.device), y[shard].to(ctx.device)  # (B/N, 32), this rank's slice
        with ctx.span(f"forward {step}", "compute"):
            loss = nn.functional.mse_loss(model(xs), ys)
        with ctx.span(f"backward {step}", "compute"):
            loss.backward()
        for p in model.parameters():
            with ctx.span("all_reduce", "comm", bytes=p.grad.numel() * p.grad.element_size()):
                dist.all_reduce(p.grad)
            p.grad /= ctx.world_size  # average: the same update as one big batch
        with ctx.span(f"step {step}", "optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=False)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"loss": loss.item(), "checksum": round(checksum, 6)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", default="runs/tour.json", help="where rank 0 writes the trace")
    args = ap.parse_args(argv)
    from parallel_lab.runtime.from_env import run_from_env

    result = run_from_env(tour_steps, steps=args.steps, trace_path=args.trace)
    if result is not None:
        sums = {v["checksum"] for v in result.values}
        print(
            f"{result.world_size} ranks, {args.steps} steps, identical weights on all ranks: {len(sums) == 1}"
        )
        print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
