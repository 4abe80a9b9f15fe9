"""Step time with a compressed gradient all-reduce: the lab's hooks against torch DDP's built-in ones.

    python benchmarks/comm_hooks.py [--ranks 2] [--d-model 256] [--layers 4] [--rounds 5]

Each rank trains a TinyGPT on its own batches. Ours: `BucketedDDP(comm="ring", hook=...)` with
`CastCompression(torch.float16)` and `PowerSGD(rank=2, start_iter=2)`; theirs, in the same run: torch's
`DistributedDataParallel` with `default_hooks.fp16_compress_hook` and `powerSGD_hook` (rank 2,
two exact steps first, as the lab's), and both without a hook.
Reported: median step time over `--rounds` x 5 steps after a warm-up, and ours / theirs (time,
lower is better). bf16's hook is left out: torch refuses it without NCCL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _results import record

from parallel_lab import launch
from parallel_lab.data_parallel import BucketedDDP, CastCompression, PowerSGD
from parallel_lab.models import GPTConfig, build_model, synthetic_batch

KINDS = ("none", "fp16", "powersgd")


def _theirs(model, kind: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "powersgd":
        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                min_compression_rate=1, use_error_feedback=True, warm_start=True, random_seed=0)  # fmt: skip
        ddp.register_comm_hook(state, P.powerSGD_hook)
    return ddp


def _ours(ctx, model, kind: str):
    hook = {"none": None, "fp16": CastCompression(torch.float16), "powersgd": PowerSGD(2, start_iter=2)}[kind]
    return BucketedDDP(model, ctx, comm="ring", hook=hook)


def step_times(ctx, cfg: GPTConfig, rounds: int) -> dict:
    out = {}
    x, y = synthetic_batch("tokens", 8, seq_len=cfg.seq_len, vocab=cfg.vocab, seed=ctx.rank)
    for _ in range(rounds):  # interleaved: drift on a shared machine hits both sides alike
        for who in ("ours", "theirs"):
            for kind in KINDS:
                model = build_model(cfg, 0)
                ddp = _ours(ctx, model, kind) if who == "ours" else _theirs(model, kind)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                times = []
                for s in range(6):
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=False)
                    ddp(x, y).backward()
                    if who == "ours":
                        ddp.finish_gradient_sync()
                    opt.step()
                    if s:  # the first step builds buckets and states
                        times.append(time.perf_counter() - t0)
                out.setdefault((who, kind), []).extend(times)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab=64, seq_len=64, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    med = launch(step_times, args.ranks, cfg, args.rounds, timeout=1800, check_shapes=False).values[0]
    print(
        f"step time, ours / torch DDP with the matching hook (lower is better); {args.ranks} ranks, "
        f"d_model {args.d_model}, {args.layers} layers"
    )
    head = f"{'hook':>9} {'ours ms':>8} {'torch ms':>9} {'ours/theirs':>12}"
    print(head)
    print("-" * len(head))
    rows = []
    for kind in KINDS:
        a, b = med[("ours", kind)], med[("theirs", kind)]
        print(f"{kind:>9} {a * 1e3:>8.1f} {b * 1e3:>9.1f} {a / b:>11.2f}x")
        rows.append({"measure": f"DDP step with {kind} hook, {args.ranks} ranks, d_model {args.d_model}",
                     "ratio": a / b, "goal": None})  # fmt: skip
    sys.stdout.flush()
    record("comm_hooks", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
