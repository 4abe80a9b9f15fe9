"""ZeRO-3 from scratch vs PyTorch's FSDP2 (`fully_shard`): step time and peak memory per rank.

    python benchmarks/zero.py [--ranks 2,4] [--d-model 128] [--layers 4] [--rounds 8]

Both train the same TinyGPT (one unit per block, the rest in the root unit, Adam) in the
same launch, on the same data, in interleaved rounds separated by barriers, so noise from
other programs hits both alike. Reported per world size: median step time of each and
the ratio ours / FSDP2 (1.00x = as fast; lower is faster), and the peak bytes one step
holds on rank 0 measured by the same referee for both (torch's
`torch.distributed._tools.mem_tracker.MemTracker`, which also sees FSDP2 freeing its
gathered parameters by resizing their storage), with the ratio ours / FSDP2.
Peaks are measured twice: with `zero_grad(set_to_none=True)` on both sides (the sharded
gradients freed between steps, torch's default), and with `set_to_none=False` on both ("kept":
ZeRO's (S,) gradient slice and FSDP2's sharded gradients stay allocated, zeroed). Our timeline recorder is off
while timing (FSDP2 has none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from _results import record

from parallel_lab import launch
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.zero.stage3 import Zero3


def run(ctx, d_model: int, layers: int, batch: int, seq: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # private-API notice
        from torch.distributed._tools.mem_tracker import MemTracker

    cfg = GPTConfig(vocab=128, seq_len=seq, d_model=d_model, n_heads=4, n_layers=layers)
    ours = build_model(cfg, seed=0, device=ctx.device)
    zero = Zero3(ctx, ours, optimizer="adam", lr=1e-3)
    theirs = build_model(cfg, seed=0, device=ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = torch.optim.Adam(theirs.parameters(), lr=1e-3)
    x, y = synthetic_batch("tokens", batch, seq_len=seq, vocab=128, seed=1 + ctx.rank, device=ctx.device)

    def step_ours(keep: bool = False) -> None:
        ours(x, y).backward()
        zero.step()
        zero.zero_grad(set_to_none=not keep)

    def step_theirs(keep: bool = False) -> None:
        theirs(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep)

    steps = {"zero3": step_ours, "fsdp2": step_theirs}
    ctx.recorder.enabled = False
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(rounds + 1):  # round 0 warms up (and creates Adam's states)
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    peaks: dict[str, dict[str, int]] = {"free": {}, "keep": {}}
    for mode in ("free", "keep"):
        for name, fn in steps.items():
            fn(keep=mode == "keep")  # so the step measured starts the way this mode leaves a step
            mt = MemTracker()
            if name == "zero3":
                mt.track_external(ours, zero.optimizer, zero.states.shard)
                if zero.states.grad_shard is not None:
                    mt.track_external(zero.states.grad_shard)
            else:
                mt.track_external(theirs, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # MemTracker notes the None .grads it meets
                with mt:
                    fn(keep=mode == "keep")
            peaks[mode][name] = int(mt.get_tracker_snapshot("peak")[ctx.device]["Total"])
    return {
        "median": {k: statistics.median(v) for k, v in times.items()},
        "peak": peaks,
        "numel": zero.layout.numel,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma separated")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8, help="timed steps of each (medians reported)")
    args = ap.parse_args(argv)
    head = (f"{'ranks':>5} {'zero3 ms':>9} {'fsdp2 ms':>9} {'time ratio':>10} {'zero3 peak':>11} "
            f"{'fsdp2 peak':>11} {'peak ratio':>10} {'kept: zero3':>12} {'fsdp2':>9} {'ratio':>7}")  # fmt: skip
    first = True
    rows = []
    for p in (int(r) for r in args.ranks.split(",")):
        res = launch(run, p, args.d_model, args.layers, args.batch, args.seq, args.rounds, timeout=900)
        v = res.values[0]
        if first:
            print(f"TinyGPT d_model={args.d_model}, {args.layers} blocks, Ψ = {v['numel']:,}, "
                  f"{args.batch} x {args.seq} tokens per rank, fp32 Adam; peak = bytes on rank 0 (MB = 1e6); "
                  "ratios are ours / FSDP2, lower is better")  # fmt: skip
            print(head)
            print("-" * len(head))
            first = False
        t, pk, kp = v["median"], v["peak"]["free"], v["peak"]["keep"]
        print(f"{p:>5} {t['zero3'] * 1e3:>9.1f} {t['fsdp2'] * 1e3:>9.1f} {t['zero3'] / t['fsdp2']:>9.2f}x "
              f"{pk['zero3'] / 1e6:>9.2f}MB {pk['fsdp2'] / 1e6:>9.2f}MB {pk['zero3'] / pk['fsdp2']:>9.2f}x "
              f"{kp['zero3'] / 1e6:>10.2f}MB {kp['fsdp2'] / 1e6:>7.2f}MB {kp['zero3'] / kp['fsdp2']:>6.2f}x")  # fmt: skip
        sys.stdout.flush()
        rows += [
            {"measure": f"ZeRO-3 step time / FSDP2, {p} ranks", "ratio": t["zero3"] / t["fsdp2"], "goal": None},
            {"measure": f"ZeRO-3 peak bytes / FSDP2, gradients freed, {p} ranks",
             "ratio": pk["zero3"] / pk["fsdp2"], "goal": 1.0},
            {"measure": f"ZeRO-3 peak bytes / FSDP2, gradients kept, {p} ranks",
             "ratio": kp["zero3"] / kp["fsdp2"], "goal": 1.0},
        ]  # fmt: skip
    record("zero", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
