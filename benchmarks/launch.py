"""Launch + teardown of a trivial 4-rank function: parallel_lab.runtime.launch vs torchrun.

Both run the same function (one all-reduce of a small tensor). launch() forks
ranks from a process that already imported torch; torchrun starts fresh
interpreters that each import torch. Prints the medians and their ratio.

    python benchmarks/launch.py [--ranks 4] [--repeats 10] [--torchrun-repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from _results import record

import parallel_lab as pl


def trivial(ctx) -> float:
    t = torch.ones(4) * ctx.rank
    dist.all_reduce(t)
    return t[0].item()


def main() -> None:
    if os.environ.get("RANK") is not None:  # we are a torchrun worker
        dist.init_process_group("gloo")
        trivial(type("Ctx", (), {"rank": dist.get_rank()})())
        dist.destroy_process_group()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--torchrun-repeats", type=int, default=3)
    a = ap.parse_args()

    pl.launch(trivial, a.ranks)  # warm-up: first fork pays for lazy imports
    ours = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        pl.launch(trivial, a.ranks)
        ours.append(time.perf_counter() - t)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    theirs = []
    for _ in range(a.torchrun_repeats):
        t = time.perf_counter()
        subprocess.run([torchrun, "--nproc-per-node", str(a.ranks), os.path.abspath(__file__)],
                       check=True, capture_output=True)  # fmt: skip
        theirs.append(time.perf_counter() - t)
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    print(f"{a.ranks}-rank trivial launch + teardown, median of {a.repeats} / {a.torchrun_repeats} runs")
    print(f"  parallel_lab.runtime.launch : {m_ours:8.3f} s")
    print(f"  torchrun            : {m_theirs:8.3f} s")
    print(f"  launch / torchrun   : {m_ours / m_theirs:8.3f}x  (time, lower is better)")
    record("launch", [{"measure": f"launch + teardown, {a.ranks} ranks / torchrun", "ratio": m_ours / m_theirs,
                       "goal": 1.0}])  # fmt: skip


if __name__ == "__main__":
    main()
