"""BucketedDDP vs torch DDP vs our naive all-reduce DP: step time, and communication hidden under backward.

    python benchmarks/ddp.py [--ranks 2,4] [--rounds 12] [--bucket-mb 1] [--d-model 256]

One launch per rank count. Every rank builds the same GPT three times, wrapped in
BucketedDDP, torch.nn.parallel.DistributedDataParallel and AllReduceDP (one
all-reduce per parameter after backward), with the same bucket size for the two
bucketed ones, and times one training step of each in interleaved rounds (a
barrier before each), so noise from other programs hits all three alike. Reported:
median step time of the slowest rank, and the ratios ours / torch DDP (<= 1.15x is
the aim) and ours / naive (below 1: faster). Then a few traced steps of ours and of
torch DDP (its buckets drawn through a comm hook) give the share of the time a
gradient all-reduce was in flight while backward was still computing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _results import record

from parallel_lab import launch
from parallel_lab.data_parallel import AllReduceDP, shard_batch, train_step
from parallel_lab.data_parallel.ddp import BucketedDDP
from parallel_lab.models import GPTConfig, build_model, make_optimizer, synthetic_batch
from parallel_lab.runtime.overlap import LayerTimer, comm_hidden_fraction
from parallel_lab.scripts.ddp import traced_allreduce_hook

NAMES = ("ours", "torch", "naive")


def _wrapped(ctx, cfg: GPTConfig, name: str, bucket_bytes: int, traced: bool = False):
    model = build_model(cfg, seed=0)
    timer = LayerTimer(model, ctx) if traced else None  # before wrapping: its hooks fire first
    if name == "ours":
        dp = BucketedDDP(model, ctx, bucket_bytes=bucket_bytes)
    elif name == "torch":
        dp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2**20)
        if traced:
            dp.register_comm_hook(ctx, traced_allreduce_hook)
    else:
        dp = AllReduceDP(model, ctx)
    opt = make_optimizer("adam", model.parameters(), 1e-4)
    return dp, opt, timer


def bench_rank(
    ctx, cfg: GPTConfig, batch: int, rounds: int, bucket_bytes: int, traced_steps: int = 3
) -> dict:
    """Median step seconds per implementation (rounds interleaved), then the hidden share of ours and torch's."""
    data = [synthetic_batch("tokens", batch, seq_len=cfg.seq_len, vocab=cfg.vocab, seed=i) for i in range(4)]
    shards = [shard_batch(b, ctx.rank, ctx.world_size) for b in data]
    ctx.recorder.enabled = False  # the timed rounds run untraced, like the built-in
    runs = {n: _wrapped(ctx, cfg, n, bucket_bytes) for n in NAMES}
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(rounds + 1):  # round 0 warms up (and lets torch DDP rebuild its buckets)
        for n in NAMES:
            dp, opt, _ = runs[n]
            dist.barrier()
            t0 = time.perf_counter()
            train_step(ctx, dp, opt, shards[i % len(shards)])
            if i > 0:
                times[n].append(time.perf_counter() - t0)
    del runs
    ctx.recorder.enabled = True
    hidden = {}
    for n in ("ours", "torch"):
        dp, opt, timer = _wrapped(ctx, cfg, n, bucket_bytes, traced=True)
        for i in range(traced_steps + 1):
            if i == 1:
                ctx.recorder.reset()
            dist.barrier()
            train_step(ctx, dp, opt, shards[i % len(shards)], timer=timer)
        hidden[n] = comm_hidden_fraction(ctx.recorder.events, ctx.rank)
    return {"median": {n: statistics.median(v) for n, v in times.items()}, "hidden": hidden}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma separated")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds (medians reported)")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size for ours and torch DDP, MiB")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab=256, seq_len=64, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    bucket_bytes = int(args.bucket_mb * 2**20)
    print(f"TinyGPT d_model={args.d_model}, {args.layers} layers: {n_params / 1e6:.2f}M parameters "
          f"({4 * n_params / 2**20:.1f} MiB of fp32 gradients), global batch {args.batch}, "
          f"buckets of {args.bucket_mb:g} MiB, {args.rounds} rounds")  # fmt: skip
    print("ratios: time ours / theirs, lower is better")
    head = (f"{'ranks':>5} {'ours ms':>8} {'torch ms':>9} {'naive ms':>9} {'ours/torch':>11} {'ours/naive':>11} "
            f"{'hidden ours':>12} {'hidden torch':>13}")  # fmt: skip
    print(head)
    print("-" * len(head))
    rows = []
    for p in [int(r) for r in args.ranks.split(",")]:
        res = launch(
            bench_rank, p, cfg, args.batch, args.rounds, bucket_bytes, check_shapes=False, timeout=900
        )
        med = {n: max(v["median"][n] for v in res.values) for n in NAMES}  # the slowest rank sets the pace
        hid = {n: statistics.fmean(v["hidden"][n] for v in res.values) for n in ("ours", "torch")}
        print(f"{p:>5} {med['ours'] * 1e3:>8.1f} {med['torch'] * 1e3:>9.1f} {med['naive'] * 1e3:>9.1f} "
              f"{med['ours'] / med['torch']:>10.2f}x {med['ours'] / med['naive']:>10.2f}x "
              f"{hid['ours']:>12.0%} {hid['torch']:>13.0%}")  # fmt: skip
        sys.stdout.flush()
        rows.append({"measure": f"BucketedDDP step / torch DDP, {p} ranks", "ratio": med["ours"] / med["torch"],
                     "goal": 1.15})  # fmt: skip
        rows.append({"measure": f"BucketedDDP step / naive all-reduce DP, {p} ranks",
                     "ratio": med["ours"] / med["naive"], "goal": 1.0})  # fmt: skip
    record("ddp", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
