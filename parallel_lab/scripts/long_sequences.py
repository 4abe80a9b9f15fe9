"""Lesson 17 as a script: train a TinyGPT with its sequence split over the ranks (context parallel).

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.long_sequences --dp 2 --method ring --zigzag
    accelerate launch --config_file parallel_lab/configs/accelerate_cpu.yaml --num_processes 2 \\
        -m parallel_lab.scripts.long_sequences --method ulysses
    python -m parallel_lab.scripts.long_sequences        # no launcher: 2 local ranks, ring, zigzag

The ranks form a dp x cp mesh (cp = ranks / dp). Each rank holds batch/dp sequences and seq/cp
of their tokens (two chunks of each with `--zigzag`); attention runs ring attention or the
all-to-all (Ulysses) version over the CP group. Rank 0 checks the losses and the weights against
one process training on the whole batch, prints the bytes each rank's attention sent next to the
formula, and writes the trace (`--trace`) that `RunResult.load` reads back.
"""

from __future__ import annotations

import argparse
import sys

import torch

from parallel_lab.context_parallel import train_dp_cp
from parallel_lab.costmodel import ring_attention_bytes, ulysses_attention_bytes
from parallel_lab.models import GPTConfig, build_model, synthetic_batch, train_reference
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world

_ATTENTION_OPS = {"ring": ("isendrecv", "sendrecv"), "ulysses": ("all_to_all",)}


def config(heads: int, seq: int, layers: int) -> GPTConfig:
    return GPTConfig(vocab=64, seq_len=seq, d_model=8 * heads, n_heads=heads, n_layers=layers)


def train_rank(ctx, cfg: GPTConfig, batches, dp: int, cp: int, method: str, zigzag: bool, steps: int) -> dict:
    out = train_dp_cp(
        ctx, build_model(cfg, 0), batches, dp=dp, cp=cp, method=method, zigzag=zigzag, steps=steps
    )
    by_op = ctx.recorder.comm_totals()["by_op"]
    out["attention_sent"] = sum(by_op.get(op, {}).get("sent", 0) for op in _ATTENTION_OPS[method])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    ap.add_argument("--zigzag", action=argparse.BooleanOptionalAction, default=None,
                    help="load-balanced causal layout (ring only; default on for ring)")  # fmt: skip
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size; cp = ranks / dp")
    ap.add_argument("--heads", type=int, default=None, help="default 4, or a multiple of cp (ulysses)")
    ap.add_argument(
        "--seq", type=int, default=None, help="sequence length (default 64, or a multiple of 2 x cp)"
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences), divisible by --dp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", default="runs/long_sequences.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    if args.dp < 1 or world % args.dp:
        ap.error(f"--dp {args.dp} must divide the {world} ranks")
    cp = world // args.dp
    zigzag = args.method == "ring" if args.zigzag is None else args.zigzag
    if zigzag and args.method == "ulysses":
        ap.error("--zigzag is a ring-attention layout; --method ulysses takes the contiguous one")
    heads = scaled_default(
        "--heads", args.heads, cp, lambda c: round_up(4, c) if args.method == "ulysses" else 4
    )
    seq = scaled_default("--seq", args.seq, cp, lambda c: round_up(64, 2 * c))
    parts = 2 * cp if zigzag else cp
    if seq % parts:
        ap.error(f"--seq {seq} must be divisible by {'2 x cp' if zigzag else 'cp'} = {parts}")
    if args.method == "ulysses" and heads % cp:
        ap.error(f"--heads {heads} must be divisible by cp = {cp} for --method ulysses")
    if args.batch % args.dp or args.steps < 1 or args.layers < 1:
        ap.error(f"--batch ({args.batch}) must divide by --dp ({args.dp}); --steps and --layers must be >= 1")
    cfg = config(heads, seq, args.layers)
    batches = [
        synthetic_batch("tokens", args.batch, seed=i, seq_len=seq, vocab=64) for i in range(args.steps)
    ]
    result = run_script(train_rank, cfg, batches, args.dp, cp, args.method, zigzag, args.steps, nproc=world,
                        trace_path=args.trace, threads=1)  # fmt: skip
    if result is None:  # not rank 0
        return 0
    ref = build_model(cfg, 0)
    want = train_reference(ref, batches, "adam", 1e-2, steps=args.steps)
    got = result.values[0]
    loss_ok = all(abs(a - b) <= 2e-5 for a, b in zip(got["losses"], want))
    params_ok = all(torch.allclose(a, b, atol=2e-4, rtol=0) for a, b in zip(got["params"], ref.parameters()))
    formula = (ring_attention_bytes if args.method == "ring" else ulysses_attention_bytes)(
        args.batch // args.dp, heads, seq // cp, 8, cp
    )
    per_call = formula["forward"] + formula["backward"]
    expected = per_call * args.layers * args.steps
    sent = [v["attention_sent"] for v in result.values]
    layout = "zigzag" if zigzag else "contiguous"
    print(f"{world} ranks ({result.backend}): dp {args.dp} x cp {cp}, {args.method} attention, {layout} layout; "
          f"{args.batch} x {seq} tokens, {heads} heads, {args.layers} layers, {args.steps} steps")  # fmt: skip
    print(f"{'step':>4} {'loss':>9} {'one process':>12}")
    for i, (a, b) in enumerate(zip(got["losses"], want)):
        print(f"{i:>4} {a:>9.5f} {b:>12.5f}")
    print(f"attention bytes sent per rank: {sent} (formula {expected:,} = {per_call:,} per layer per step)")
    print(
        "attention bytes equal the formula"
        if all(s == expected for s in sent)
        else "BYTES DIFFER from the formula"
    )
    ok = loss_ok and params_ok and all(s == expected for s in sent)
    print(
        "matches single-process training" if loss_ok and params_ok else "DIFFERS from single-process training"
    )
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
