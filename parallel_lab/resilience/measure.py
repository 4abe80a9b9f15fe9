"""How long a checkpoint blocks training: the flash copy against torch's ways of saving.

Each rank holds the same kind of state (weights and Adam's two moments, fp32) and saves it, in
interleaved rounds: a flash snapshot into shared memory (`flash.snapshot`), `torch.save` of the
state to a file, `torch.distributed.checkpoint.save` (DCP: every rank writes its tensors, the
coordinator the metadata) and `torch.distributed.checkpoint.async_save` (DCP copies the state to
host memory, returns, and writes in a background thread). Measured: the seconds until training
could go on (for async_save: until it returned; it is waited for before the next round, not counted).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch

from parallel_lab import comms
from parallel_lab.resilience import flash


def blocked_seconds(ctx, root: str, spec: flash.FlashSpec, numel: int = 1 << 20, rounds: int = 5) -> dict:
    """Seconds each way of checkpointing blocks this rank, over `rounds` interleaved rounds (one
    warm-up round first): {"median": {way: s}, "spread": {way: (fastest, slowest)}, "bytes": per
    rank}. The state is in host memory (on GPUs a device-to-host copy would come first, not timed
    here). Launch it on gloo: DCP's async_save needs a CPU backend. `spec`: a `FlashAgent`'s
    segments, made by the launching process."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(ctx.rank)
    state = {k: torch.randn(numel, generator=g) for k in ("weight", "exp_avg", "exp_avg_sq")}  # 3 x (numel,)
    times: dict[str, list[float]] = {k: [] for k in ("flash", "torch.save", "dcp.save", "dcp.async_save")}
    pending = None
    for i in range(rounds + 1):
        for name in times:
            d = os.path.join(root, f"{name}-{i}")
            comms.dist_barrier(ctx)
            t0 = time.perf_counter()
            if name == "flash":
                flash.snapshot(spec, ctx.rank, i, {"shard": state}, ctx.world_size)
            elif name == "torch.save":
                os.makedirs(d, exist_ok=True)
                torch.save(state, os.path.join(d, f"rank{ctx.rank}.pt"))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # DCP's notes about the default planner
                    if name == "dcp.save":
                        dcp.save({"state": state}, checkpoint_id=d)
                    else:
                        pending = dcp.async_save({"state": state}, checkpoint_id=d)
            dt = time.perf_counter() - t0
            if pending is not None:
                pending.result()  # the background write, waited for outside the measured time
                pending = None
            if i:
                times[name].append(dt)
    return {
        "median": {k: statistics.median(v) for k, v in times.items()},
        "spread": {k: (min(v), max(v)) for k, v in times.items()},
        "bytes": 3 * numel * 4,
    }


__all__ = ["blocked_seconds"]
