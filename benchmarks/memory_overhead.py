"""Slowdown of a training step under `MemoryTracker`, vs the same step untracked.

On CPU the tracker wraps torch's CPU allocator in C++ (runtime/alloc_hook.py): its
cost is a hash-map update per allocation, whatever the op. The fallback mechanism
(a `TorchDispatchMode`, used on other devices or without a compiler) makes one trip
through Python per aten op, a fixed few microseconds, so its ratio depends on how
much work each op does. The script times a small-MLP Adam step at several sizes
under both, and under an empty dispatch mode: the floor any dispatch-mode tracker
pays.

    python benchmarks/memory_overhead.py            # the table
    python benchmarks/memory_overhead.py --quick    # fewer repeats

Timings interleave the three variants and take medians, so a busy machine skews
them less; run it on an idle machine for numbers you report.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _results import record
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.models import TinyMLP
from parallel_lab.runtime.memory import MemoryTracker


class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _step_fn(hidden: int, depth: int, batch: int):
    torch.manual_seed(0)
    model = TinyMLP(hidden, hidden, hidden, depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)  # (B, H) each

    def step() -> None:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return model, opt, step


def _time(step, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def measure(hidden: int, depth: int, batch: int, rounds: int = 7, n: int = 10) -> dict[str, float]:
    """Median seconds per step: plain, under an empty dispatch mode, under the dispatch-mode
    tracker, and under the default tracker (the allocator hook on CPU)."""
    model, opt, step = _step_fn(hidden, depth, batch)
    for _ in range(3):
        step()  # warm-up: optimizer state exists, allocator warm
    out: dict[str, list[float]] = {"plain": [], "empty_mode": [], "dispatch": [], "tracked": []}
    for _ in range(rounds):
        out["plain"].append(_time(step, n))
        with _EmptyMode():
            out["empty_mode"].append(_time(step, n))
        for name, mechanism in (("dispatch", "dispatch"), ("tracked", "auto")):
            mem = MemoryTracker(mechanism=mechanism)
            with mem:  # registered as a lesson does: gradients and optimizer state relabelled
                mem.register_module(model)
                mem.register_optimizer(opt)
                out[name].append(_time(step, n))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier timings)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds, n = (3, 5) if args.quick else (7, 10)
    configs = [(64, 2, 32), (256, 2, 64), (512, 4, 64), (1024, 4, 128)]
    print("time with / without, lower is better")
    print(f"tracker: {MemoryTracker().mechanism} (the default on CPU); the dispatch-mode fallback beside it")
    print(
        f"{'hidden':>6} {'depth':>5} {'batch':>5} {'plain ms':>9} {'empty mode':>10} {'dispatch':>9} {'tracked':>8}"
    )
    rows = []
    for hidden, depth, batch in configs:
        r = measure(hidden, depth, batch, rounds, n)
        rows.append({"measure": f"Adam step under MemoryTracker / untracked, MLP hidden {hidden}",
                     "ratio": r["tracked"] / r["plain"], "goal": 1.3})  # fmt: skip
        print(
            f"{hidden:>6} {depth:>5} {batch:>5} {r['plain'] * 1e3:>9.2f} "
            f"{r['empty_mode'] / r['plain']:>9.2f}x {r['dispatch'] / r['plain']:>8.2f}x {r['tracked'] / r['plain']:>7.2f}x"
        )

    record("memory_overhead", rows)


if __name__ == "__main__":
    main()
