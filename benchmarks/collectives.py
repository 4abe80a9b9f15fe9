"""Ring all-reduce from scratch vs the backend's built-in all-reduce (gloo on CPU, NCCL on GPU).

    python benchmarks/collectives.py [--sizes 4,16,64] [--ranks 2,4] [--repeats 15]

Ours and the built-in run in the same launch, in interleaved rounds on the same fp32
tensor, so noise from other programs hits both alike. Reported: median time,
algorithmic bandwidth (size / time, what nccl-tests calls algbw), and the time ratio
ours / built-in, lower is better: 1.00x means as fast as the built-in, 1.10x means 10%
slower. The goal, at or below 1.00x, is set for the pipelined ring at 2 ranks; 4 ranks
oversubscribe a 2-core machine and are reported only.
"""

from __future__ import annotations

import argparse
import sys

from _results import record

from parallel_lab import launch
from parallel_lab.scripts.collectives import ALL_REDUCES, time_all_reduce


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,16,64", help="tensor sizes in MB (fp32), comma separated")
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma separated")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per size (medians reported)")
    ap.add_argument("--impls", default="ring,ring_pipelined", help=f"ours, among {sorted(ALL_REDUCES)}")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    impls = ("built-in", *[s for s in args.impls.split(",") if s and s != "built-in"])
    head = f"{'ranks':>5} {'MB':>6} {'impl':>15} {'median ms':>10} {'algbw GB/s':>11} {'ours/built-in':>14}"
    print("time ours / built-in, lower is better")
    print(head)
    print("-" * len(head))
    rows = []
    for p in ranks:
        for mb in sizes:
            numel = int(mb * 2**20) // 4
            res = launch(time_all_reduce, p, numel, args.repeats, impls, check_shapes=False, timeout=600)
            med, ratio = res.values[0]["median"], res.values[0]["ratio"]
            for name in impls:
                t = med[name]
                r = "" if name == "built-in" else f"{ratio[name]:.2f}x"
                if name != "built-in":
                    goal = 1.0 if (name == "ring_pipelined" and p == 2) else None
                    rows.append({"measure": f"{name} all-reduce / built-in, {p} ranks, {mb:g} MB",
                                 "ratio": ratio[name], "goal": goal})  # fmt: skip
                print(f"{p:>5} {mb:>6g} {name:>15} {t * 1e3:>10.2f} {numel * 4 / t / 1e9:>11.2f} {r:>14}")
            sys.stdout.flush()
    record("collectives", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
