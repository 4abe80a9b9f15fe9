"""How long a checkpoint blocks training: flash copy to shared memory vs torch.save, DCP save, DCP async_save.

    python benchmarks/checkpoint.py [--ranks 2] [--sizes 1,4] [--rounds 5]

Each rank saves weights and Adam's two moments (3 x numel fp32; sizes in Mi elements) in
interleaved rounds of the four ways (`parallel_lab.resilience.measure.blocked_seconds`), to a
temporary folder. Reported: median seconds training waited, and ours / theirs (time, lower is
better). torch.save and DCP write through the page cache; none of them waits for the disk itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from _results import record

from parallel_lab import launch
from parallel_lab.resilience import FlashAgent, blocked_seconds

THEIRS = ("torch.save", "dcp.save", "dcp.async_save")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="1,4", help="Mi elements per tensor, comma separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print("blocked time, ours (flash) / theirs, lower is better")
    head = (f"{'ranks':>5} {'MB/rank':>8} {'flash ms':>9} {'torch.save ms':>14} {'dcp.save ms':>12} "
            f"{'async_save ms':>14} {'/torch.save':>12} {'/dcp.save':>10} {'/async_save':>12}")  # fmt: skip
    print(head)
    print("-" * len(head))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for mi in (float(s) for s in args.sizes.split(",")):
            numel = int(mi * 2**20)
            with FlashAgent(args.ranks, 12 * numel + (1 << 20), f"{d}/agent", persist_every=10**9) as agent:
                res = launch(  # gloo on any machine: the state is on the CPU, and async_save needs a CPU backend
                    blocked_seconds, args.ranks, f"{d}/{numel}", agent.spec, numel, args.rounds,
                    backend="gloo", timeout=900,
                )  # fmt: skip
            m, spread = res.values[0]["median"], res.values[0]["spread"]
            mb = res.values[0]["bytes"] / 1e6
            print(f"{args.ranks:>5} {mb:>8.1f} {m['flash'] * 1e3:>9.1f} {m['torch.save'] * 1e3:>14.1f} "
                  f"{m['dcp.save'] * 1e3:>12.1f} {m['dcp.async_save'] * 1e3:>14.1f} "
                  + " ".join(f"{m['flash'] / m[k]:>{w}.2f}x" for k, w in zip(THEIRS, (11, 9, 11))))  # fmt: skip
            print("      fastest-slowest round, ms: " + ", ".join(
                f"{k} {spread[k][0] * 1e3:.1f}-{spread[k][1] * 1e3:.1f}" for k in ("flash", *THEIRS)))  # fmt: skip
            sys.stdout.flush()
            rows += [{"measure": f"checkpoint blocked time, flash / {k}, {args.ranks} ranks, {mb:.0f} MB per rank",
                      "ratio": m["flash"] / m[k], "goal": 1.0} for k in THEIRS]  # fmt: skip
    record("checkpoint", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
