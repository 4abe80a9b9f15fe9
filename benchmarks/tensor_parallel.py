"""Our tensor-parallel MLP vs DTensor's ColwiseParallel/RowwiseParallel on the same weights.

    python benchmarks/tensor_parallel.py [--hidden 256,512,1024] [--ranks 2,4] [--repeats 9]

One Megatron MLP (C -> 4C -> C, fc by columns, proj by rows) forward + backward on a
(8, 64, C) fp32 batch. Ours runs with the from-scratch ring collectives ("ring") and
with torch.distributed's ("builtin"); DTensor runs torch's own plan. All three run in
the same launch, in interleaved rounds, so noise from other programs hits them alike.
Reported: median time and the time ratio ours / DTensor, lower is better: 1.00x means as
fast as DTensor, 1.10x means 10% slower.
"""

from __future__ import annotations

import argparse
import sys

from _results import record

from parallel_lab import launch
from parallel_lab.scripts.tensor_parallel import time_mlp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="256,512,1024", help="model widths C, comma separated")
    ap.add_argument("--ranks", default="2,4", help="tensor-parallel sizes, comma separated")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (medians reported)")
    args = ap.parse_args(argv)
    impls = ("dtensor", "ring", "builtin")
    head = f"{'ranks':>5} {'C':>6} {'impl':>8} {'median ms':>10} {'ours/DTensor':>13}"
    print("time ours / DTensor, lower is better")
    rows = []
    print(head)
    print("-" * len(head))
    for p in (int(r) for r in args.ranks.split(",")):
        for c in (int(h) for h in args.hidden.split(",")):
            res = launch(time_mlp, p, c, 8, 64, args.repeats, impls, check_shapes=False, timeout=600).values[
                0
            ]
            for name in impls:
                r = "" if name == "dtensor" else f"{res['ratio'][name]:.2f}x"
                if name != "dtensor":
                    rows.append({"measure": f"Megatron MLP ({name} comms) / DTensor, {p} ranks, C = {c}",
                                 "ratio": res["ratio"][name], "goal": None})  # fmt: skip
                print(f"{p:>5} {c:>6} {name:>8} {res['median'][name] * 1e3:>10.2f} {r:>13}")
            sys.stdout.flush()
    record("tensor_parallel", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
