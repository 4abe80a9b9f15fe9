"""Lesson 01 as a script: every from-scratch collective once, checked against torch.distributed.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.collectives
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.collectives
    python -m parallel_lab.scripts.collectives            # no launcher: 4 local ranks via parallel_lab.runtime.launch

Rank 0 prints one row per collective (right answer on every rank, bytes this rank
sent, the ring/tree formula, time) and writes the trace (`--trace`, default
runs/collectives.json) that `RunResult.load` reads back in the notebook.
The data are small integers, so every summation order gives the same bits: a
correct collective differs from the built-in by exactly 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from parallel_lab import comms as C
from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.from_env import run_script

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def run_collectives(ctx, numel: int = 1000, dtype: str = "float32") -> list[dict]:
    """Run each collective on this rank; return one row per op: ok, max diff, bytes sent, formula, ms."""
    p, r, dt = ctx.world_size, ctx.rank, DTYPES[dtype]
    g = torch.Generator().manual_seed(ctx.seed + r)
    x = torch.randint(-8, 9, (numel,), generator=g).to(dt).to(ctx.device)  # (numel,), this rank's data
    b = x.element_size()
    summed = x.clone()
    dist.all_reduce(summed)
    gathered = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(gathered, x)
    root = p - 1
    bcast = x.clone()
    dist.broadcast(bcast, src=root)
    pieces = [x + 100 * j for j in range(p)]
    # all_to_all_single: every backend has it (gloo in some torch releases lacks the list form)
    out = torch.empty(p * numel, dtype=dt, device=ctx.device)  # (p * numel,)
    dist.all_to_all_single(out, torch.cat(pieces))
    swapped = list(out.chunk(p))
    ring, tree = C.ring_bytes_per_rank, C.tree_bytes_per_rank

    # (name, call, expected result, the formula's bytes sent by this rank)
    cases = [
        (
            "ring_all_reduce",
            lambda: C.ring_all_reduce(ctx, x.clone()),
            summed,
            ring(numel, p, b, "all_reduce")[r][0],
        ),
        (
            "ring_all_reduce_pipelined",
            lambda: C.ring_all_reduce_pipelined(ctx, x.clone()),
            summed,
            ring(numel, p, b, "all_reduce")[r][0],
        ),
        (
            "ring_reduce_scatter",
            lambda: C.ring_reduce_scatter(ctx, x),
            summed.split(C.chunk_sizes(numel, p))[r],
            ring(numel, p, b, "reduce_scatter")[r][0],
        ),
        (
            "ring_all_gather",
            lambda: C.ring_all_gather(ctx, x),
            torch.stack(gathered),
            ring(numel * p, p, b, "all_gather")[r][0],
        ),
        (
            "tree_broadcast",
            lambda: C.tree_broadcast(ctx, x.clone(), src=root),
            bcast,
            tree(numel, p, b, "broadcast", root)[r][0],
        ),
        (
            "tree_reduce",
            lambda: C.tree_reduce(ctx, x.clone(), dst=root),
            summed if r == root else None,
            tree(numel, p, b, "reduce", root)[r][0],
        ),
        (
            "tree_all_reduce",
            lambda: C.tree_all_reduce(ctx, x.clone()),
            summed,
            tree(numel, p, b, "reduce", 0)[r][0] + tree(numel, p, b, "broadcast", 0)[r][0],
        ),
        (
            "naive_all_reduce",
            lambda: C.naive_all_reduce(ctx, x.clone()),
            summed,
            (numel * b if r else (p - 1) * numel * b) if p > 1 else 0,
        ),
        ("all_to_all", lambda: C.all_to_all(ctx, pieces), swapped, (p - 1) * numel * b),
        (
            "all_reduce",
            lambda: C.dist_all_reduce(ctx, x.clone()),
            summed,
            ring(numel, p, b, "all_reduce")[r][0],
        ),
    ]
    rows = []
    for name, call, want, formula in cases:
        before = ctx.recorder.comm.get(name.replace("_pipelined", ""), {}).get("sent", 0)
        watch = mesh.Stopwatch(ctx.device)  # device time on a GPU: a host clock would time the launch
        with watch():
            got = call()
        ms = watch.seconds * 1e3
        sent = ctx.recorder.comm[name.replace("_pipelined", "")]["sent"] - before
        if want is None:  # tree_reduce off the root returns None
            ok, diff = got is None, 0.0
        else:
            got, want = (torch.stack(got), torch.stack(want)) if isinstance(want, list) else (got, want)
            ok = got.shape == want.shape and torch.equal(got, want)
            shaped = got.shape == want.shape and got.numel() > 0
            diff = (got.double() - want.double()).abs().max().item() if shaped else 0.0
        rows.append(
            {"op": name, "ok": bool(ok), "max_diff": diff, "sent": sent, "formula": formula, "ms": ms}
        )
    return rows


#: all-reduce implementations `time_all_reduce` knows
ALL_REDUCES = {
    "built-in": lambda ctx, t: dist.all_reduce(t),
    "ring": lambda ctx, t: C.ring_all_reduce(ctx, t),
    "ring_pipelined": lambda ctx, t: C.ring_all_reduce_pipelined(ctx, t),
    "tree": lambda ctx, t: C.tree_all_reduce(ctx, t),
    "naive": lambda ctx, t: C.naive_all_reduce(ctx, t),
}


def time_all_reduce(ctx, numel: int, repeats: int = 5, impls: tuple[str, ...] = ("built-in", "ring")) -> dict:
    """Seconds per all-reduce of `numel` fp32 for each implementation, on rank 0's clock.

    Rounds interleave the implementations (noise from other programs hits all alike);
    each call starts after a barrier; round 0 is a warm-up. Returns
    {"median": {impl: s}, "ratio": {impl: median t_impl / median t_built-in}} (the time
    ratio ours / built-in, lower is better: 1.0 = as fast as the built-in, 1.1 = 10% slower).
    Turn shape checks off (`launch(..., check_shapes=False)`) to time the algorithm alone.
    """
    unknown = [i for i in impls if i not in ALL_REDUCES]
    if unknown:
        raise ValueError(f"impls must be among {sorted(ALL_REDUCES)}, got {unknown}")
    x = torch.ones(numel, device=ctx.device)  # (numel,)
    times: dict[str, list[float]] = {k: [] for k in impls}
    for i in range(repeats + 1):
        for name in impls:
            dist.barrier()
            mesh.synchronize(ctx.device)
            t0 = time.perf_counter()
            ALL_REDUCES[name](ctx, x)
            mesh.synchronize(ctx.device)
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"median": med, "ratio": {}}
    if "built-in" in impls:  # time ours / built-in: lower is better
        out["ratio"] = {k: med[k] / med["built-in"] for k in impls}
    return out


def report(values: list[list[dict]]) -> tuple[str, bool]:
    """One line per op, over all ranks: ok everywhere, worst diff, rank 0's bytes vs formula, slowest time."""
    lines = [f"{'collective':<26} {'ok':>3} {'max|diff|':>9} {'rank0 sent B':>13} {'formula':>9} {'ms':>7}"]
    all_ok = True
    for i, row in enumerate(values[0]):
        ok = all(v[i]["ok"] for v in values) and all(
            v[i]["formula"] is None or v[i]["sent"] == v[i]["formula"] for v in values
        )
        all_ok &= ok
        diff = max(v[i]["max_diff"] for v in values)
        formula = "" if row["formula"] is None else str(row["formula"])
        ms = max(v[i]["ms"] for v in values)
        lines.append(
            f"{row['op']:<26} {'yes' if ok else 'NO':>3} {diff:>9.3g} {row['sent']:>13} {formula:>9} {ms:>7.2f}"
        )
    return "\n".join(lines), all_ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--numel", type=int, default=1000, help="elements per rank (any count, e.g. 7 or 1000003)"
    )
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--trace", default="runs/collectives.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    if args.numel < 0:
        ap.error("--numel must be >= 0")
    result = run_script(
        run_collectives, nproc=args.nproc, trace_path=args.trace, numel=args.numel, dtype=args.dtype
    )
    if result is None:  # not rank 0
        return 0
    table, ok = report(result.values)
    print(f"{result.world_size} ranks ({result.backend}), {args.numel} x {args.dtype} per rank")
    print(table)
    print(
        "all collectives match torch.distributed" if ok else "SOME COLLECTIVES DIFFER from torch.distributed"
    )
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
