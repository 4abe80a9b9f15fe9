"""Lesson 14 as a script: serve a TinyGPT on several ranks, tensor- or pipeline-parallel.

    torchrun --nproc-per-node 2 -m parallel_lab.scripts.inference --mode tp
    accelerate launch --config_file parallel_lab/configs/accelerate_cpu.yaml --num_processes 2 \\
        -m parallel_lab.scripts.inference --mode pp --microbatches 2
    python -m parallel_lab.scripts.inference --mode tp     # no launcher: 2 local ranks

`--mode tp`: every rank holds n_heads/p query heads and kv_heads/p key/value heads (its part of
the KV cache) and all-reduces twice per layer per forward. `--mode pp`: every rank holds
layers/p layers and their cache, and sends only activations (and the chosen tokens back).
Rank 0 checks the generated tokens against one process generating with a KV cache, prints the
bytes each rank sent next to the formula, and writes the trace (`--trace`) that `RunResult.load`
reads back.
"""

from __future__ import annotations

import argparse
import sys

import torch

from parallel_lab.inference import (
    KVCache,
    ServingGPT,
    generate,
    pp_generate,
    pp_serving_bytes,
    tp_generate,
    tp_serving_bytes,
)
from parallel_lab.models import GPTConfig, build_model
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world


def serving_model(heads: int, kv_heads: int, layers: int, seed: int = 0) -> ServingGPT:
    """The same model on every rank (head size 8), built from the seed."""
    cfg = GPTConfig(vocab=64, seq_len=64, d_model=8 * heads, n_heads=heads, n_layers=layers)
    return ServingGPT.from_gpt(build_model(cfg, seed).eval(), kv_heads)


def serve_rank(ctx, mode: str, heads: int, kv_heads: int, layers: int, prompt: torch.Tensor, new_tokens: int,
               microbatches: int) -> dict:  # fmt: skip
    model = serving_model(heads, kv_heads, layers)
    if mode == "tp":
        return tp_generate(ctx, model, prompt, new_tokens)
    return pp_generate(ctx, model, prompt, new_tokens, microbatches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("tp", "pp"), default="tp")
    ap.add_argument(
        "--heads", type=int, default=None, help="query heads (default 8, or a multiple of the ranks)"
    )
    ap.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads (default 4, or a multiple of the ranks)"
    )
    ap.add_argument("--layers", type=int, default=None, help="default 4, or a multiple of the ranks")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=2, help="pipeline micro-batches (--mode pp)")
    ap.add_argument("--trace", default="runs/inference.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    heads = scaled_default("--heads", args.heads, world, lambda w: round_up(8, w))
    kv_heads = scaled_default("--kv-heads", args.kv_heads, world, lambda w: round_up(4, w))
    layers = scaled_default("--layers", args.layers, world, lambda w: round_up(4, w))
    if heads % kv_heads:
        ap.error(f"--kv-heads {kv_heads} must divide --heads {heads}")
    if args.mode == "tp" and kv_heads % world:
        ap.error(f"--kv-heads {kv_heads} must be divisible by the {world} tensor-parallel ranks")
    if args.mode == "pp" and (layers % world or args.batch % args.microbatches):
        ap.error(f"--layers ({layers}) must divide by the {world} stages and --batch ({args.batch}) by "
                 f"--microbatches ({args.microbatches})")  # fmt: skip
    if args.prompt < 1 or args.new_tokens < 1 or args.prompt + args.new_tokens > 64:
        ap.error(
            f"--prompt ({args.prompt}) + --new-tokens ({args.new_tokens}) must fit 64 positions, each >= 1"
        )
    prompt = torch.randint(64, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    result = run_script(serve_rank, args.mode, heads, kv_heads, layers, prompt, args.new_tokens, args.microbatches,
                        nproc=world, trace_path=args.trace, threads=1)  # fmt: skip
    if result is None:  # not rank 0
        return 0
    model = serving_model(heads, kv_heads, layers)
    want = generate(model, prompt, args.new_tokens, KVCache())
    got = result.values[0 if args.mode == "tp" else -1]["tokens"]
    ok = torch.equal(got, want)
    sent = [v["sent"] for v in result.values]
    if args.mode == "tp":
        formula = tp_serving_bytes(args.batch, args.prompt, args.new_tokens, model.cfg.d_model, layers, world)
        how = f"heads {heads}/{world} and kv heads {kv_heads}/{world} per rank"
    else:
        formula = pp_serving_bytes(args.batch, args.prompt, args.new_tokens, model.cfg.d_model, world)
        how = f"{layers // world} layers per stage, {args.microbatches} micro-batches"
    print(f"{world} ranks ({result.backend}), {args.mode}: {how}; batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens")  # fmt: skip
    print(f"{'rank':>4} {'sent (B)':>12} {'formula (B)':>12} {'KV cache (B)':>13}")
    for r, (s, f) in enumerate(zip(sent, formula)):
        print(f"{r:>4} {s:>12,} {f:>12,} {result.values[r]['cache_bytes']:>13,}")
    print("bytes equal the formula" if sent == formula else "BYTES DIFFER from the formula")
    print("tokens match the single-process model" if ok else "TOKENS DIFFER from the single-process model")
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0 if ok and sent == formula else 1


if __name__ == "__main__":
    raise SystemExit(main())
