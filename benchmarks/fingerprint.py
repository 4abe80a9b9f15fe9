"""What the collective fingerprint check costs: a ring all-reduce with it, over the same without it.

    python benchmarks/fingerprint.py [--ranks 2,4] [--repeats 21]

Before every traced collective the ranks all-gather a 14-number fingerprint (collective, reduce
op, root, size, dtype, shape) and compare. This times `comms.ring_all_reduce` on message sizes
like the lessons' with the check on and off, interleaved in one launch. Reported per size:
median times and the ratio with / without (time, lower is better; 1.00x = free).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _results import record

from parallel_lab import comms, launch

SIZES = (1 << 10, 16 << 10, 256 << 10, 4 << 20)  # bytes: 1 KiB .. 4 MiB of fp32


def _time(ctx, repeats: int, block: int = 20) -> dict:
    """Median seconds per call, timed over blocks of `block` back-to-back calls (as a training step
    makes them): one call timed alone mostly measures how the two ranks happened to line up."""
    out = {}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4, device=ctx.device)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for i in range(repeats + 1):
            for check in (True, False):
                ctx.check_shapes = check
                comms.dist_barrier(ctx)
                t0 = time.perf_counter()
                for _ in range(block):
                    comms.ring_all_reduce(ctx, t)
                if i:
                    runs[check].append((time.perf_counter() - t0) / block)
        out[nbytes] = {k: statistics.median(v) for k, v in runs.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args(argv)
    print(
        f"{'ranks':>5} {'bytes':>9} {'checked ms':>11} {'unchecked ms':>13} {'with / without (time, lower is better)':>40}"
    )
    rows = []
    for p in (int(r) for r in args.ranks.split(",")):
        res = launch(_time, p, args.repeats, timeout=600).values[0]
        for nbytes, med in res.items():
            rows.append({"measure": f"ring all-reduce, fingerprint check on / off, {p} ranks, {nbytes:,} B",
                         "ratio": med[True] / med[False], "goal": None})  # fmt: skip
            print(
                f"{p:>5} {nbytes:>9,} {med[True] * 1e3:>11.3f} {med[False] * 1e3:>13.3f} {med[True] / med[False]:>39.2f}x"
            )
    record("fingerprint", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
